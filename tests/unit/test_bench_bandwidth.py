"""`llamapy bench`'s bandwidth figures (issue 11 item 7): the weight bytes a decode step reads,
the read-bandwidth probe, and the extra markdown columns and JSON fields. No timing assertion:
only that the figures exist, are positive and are computed from each other as documented."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
from gguf import GGMLQuantizationType as T

from tests_support import cli


def _expected_bytes(path: Path) -> int:
    """From the file alone: every 2-D weight but token_embd, plus token_embd whole when the
    output is tied to it (the output MUL_MAT reads it), plus one token_embd row (GET_ROWS)."""
    r = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in r.tensors}
    emb = by_name["token_embd.weight"]
    mats = sum(int(t.n_bytes) for t in r.tensors if len(t.shape) == 2 and t.name != "token_embd.weight")
    n_rows = int(emb.shape[1])  # gguf-py lists shapes innermost first: (n_embd, n_vocab)
    tied = "output.weight" not in by_name
    return mats + (int(emb.n_bytes) if tied else 0) + int(emb.n_bytes) // n_rows


@pytest.mark.parametrize(("qtype", "embd_type", "tied"), [(T.Q8_0, None, True), (T.Q4_0, T.F16, False)])
def test_decode_weight_bytes_of_a_written_model(
    make_llama: Callable[..., Path], qtype: T, embd_type: T | None, tied: bool
) -> None:
    from llamapy.cli.bench import decode_weight_bytes
    from llamapy.context import Model, ModelOptions

    path = make_llama(n_layer=2, qtype=qtype, embd_type=embd_type, tied=tied)
    m = Model(path, ModelOptions(n_gpu_layers=0))
    try:
        got = decode_weight_bytes(m)
    finally:
        m.free()
    assert got == _expected_bytes(path)


def test_read_probe_gives_a_positive_figure() -> None:
    from llamapy.cli.bench import read_bandwidth

    for n in (1, 2):
        p = read_bandwidth(n, 8 << 20, passes=2)
        assert p.n_threads == n and p.nbytes == 8 << 20
        assert p.seconds > 0 and p.gbs == pytest.approx(p.nbytes / p.seconds / 1e9)


def test_bench_bandwidth_columns_and_fields(make_llama: Callable[..., Path]) -> None:
    path = make_llama(n_layer=1)
    args = [str(path), "-p", "8", "-n", "2", "-r", "1", "-t", "1", "--no-warmup", "--probe-mib", "8"]

    r = cli("bench", *args)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    # llama-bench's columns first and unchanged, llamapy's after them
    assert head == ["model", "size", "params", "backend", "ngl", "threads", "test", "t/s", "eff GB/s", "of probe"]
    rows = {ln.split("|")[7].strip(): [c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:4]}
    assert rows["pp8"][8:] == ["-", "-"]  # a prompt batch has no per-token bandwidth
    assert float(rows["tg2"][8]) > 0 and rows["tg2"][9].endswith(" %")
    notes = "\n".join(lines[4:])
    assert "MB of weights a token" in notes and "read probe, 1 thread: " in notes and "8 MiB" in notes

    r = cli("bench", *args, "-o", "json")
    assert r.returncode == 0, r.stderr
    pp, tg = json.loads(r.stdout)
    assert pp["n_prompt"] == 8 and tg["n_gen"] == 2
    assert tg["weight_bytes_per_token"] == pp["weight_bytes_per_token"] == _expected_bytes(path)
    assert tg["eff_bw_gbs"] == pytest.approx(tg["weight_bytes_per_token"] * tg["avg_ts"] / 1e9)
    assert tg["probe_bw_gbs"] > 0 and tg["probe_bytes"] == 8 << 20 and "numpy" in tg["probe_method"]
    assert tg["bw_fraction"] == pytest.approx(tg["eff_bw_gbs"] / tg["probe_bw_gbs"])
    assert pp["eff_bw_gbs"] is None and pp["bw_fraction"] is None

    # --probe-mib 0: llama-bench's table alone
    r = cli("bench", *args[:-1], "0")
    assert r.returncode == 0, r.stderr
    assert "eff GB/s" not in r.stdout and len(r.stdout.splitlines()) == 4
    r = cli("bench", *args[:-2], "--probe-mib", "-1")
    assert r.returncode == 1 and r.stderr.startswith("error: --probe-mib -1")
