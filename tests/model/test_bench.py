"""`llamapy bench` (llama-bench): the markdown table and the JSON fields, on tiny32 at tiny sizes."""

from __future__ import annotations

import json

import pytest

from llamapy.cli import main
from tests_support import SHARED

TINY32 = SHARED / "reference" / "tiny32" / "tiny32-Q4_K_M.gguf"

pytestmark = pytest.mark.skipif(not TINY32.exists(), reason="tiny32 reference model missing")

JSON_FIELDS = {
    "model_filename", "model_type", "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads",
    "n_gpu_layers", "n_prompt", "n_gen", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "samples_ns",
    "samples_ts", "backends", "test_time", "type_k", "type_v",
}  # fmt: skip


def test_bench_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    # --probe-mib 0: llama-bench's own table (the bandwidth columns: tests/unit/test_bench_bandwidth.py)
    main(["bench", str(TINY32), "-p", "16", "-n", "4", "-r", "1", "-t", "1", "--probe-mib", "0"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["model", "size", "params", "backend", "ngl", "threads", "test", "t/s"]
    assert set(lines[1]) <= set("|-: ") and lines[1].count("|") == 9
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert [r[6] for r in rows] == ["pp16", "tg4"]
    for r in rows:
        assert r[0] == "llama 42M Q4_K - Medium"
        assert r[1].endswith(" MiB") and r[2] == "41.57 M"
        assert r[4] == "0" and r[5] == "1"
        avg, pm, std = r[7].split()
        assert pm == "±" and float(avg) > 0 and float(std) == 0.0  # one repetition
    assert all(len(ln) == len(lines[0]) for ln in lines)  # llama-bench's fixed column widths


def test_bench_json_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    main(["bench", str(TINY32), "-p", "8", "-n", "2", "-r", "2", "-t", "1,2", "-ub", "4", "-o", "json", "--no-warmup",
          "--probe-mib", "8"])  # fmt: skip
    res = json.loads(capsys.readouterr().out)
    assert isinstance(res, list) and len(res) == 4  # 2 thread counts x (pp, tg)
    for r in res:
        assert JSON_FIELDS <= set(r)
        assert r["model_type"] == "llama 42M Q4_K - Medium" and r["model_n_params"] == 41566464
        assert r["n_ubatch"] == 4 and r["n_batch"] == 2048 and r["n_gpu_layers"] == 0
        assert len(r["samples_ns"]) == len(r["samples_ts"]) == 2
        assert r["avg_ts"] > 0 and r["avg_ns"] > 0
        n = r["n_prompt"] + r["n_gen"]
        assert r["samples_ts"][0] == pytest.approx(1e9 * n / r["samples_ns"][0])
    assert [(r["n_threads"], r["n_prompt"], r["n_gen"]) for r in res] == [(1, 8, 0), (1, 0, 2), (2, 8, 0), (2, 0, 2)]
    # one read probe per thread count, on its tg test
    tg = [r for r in res if r["n_gen"]]
    assert all(r["probe_bw_gbs"] > 0 and r["eff_bw_gbs"] > 0 for r in tg)
    assert tg[0]["probe_bw_gbs"] != tg[1]["probe_bw_gbs"]


@pytest.mark.parametrize("flag", [[], ["--f32-activations"]])
def test_bench_activation_mode(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                               flag: list[str]) -> None:
    """--f32-activations reaches the model and every context (so the default, 8-bit mode and the
    float32 one can be measured side by side, CUDA's int8 decode products among them), and the JSON
    says which."""
    from llamapy import context

    modes: list[str] = []
    real = context.Context.__init__

    def spy(self: context.Context, model: object, options: context.ContextOptions, *a: object, **k: object) -> None:
        modes.append(options.cpu_matmul)
        real(self, model, options, *a, **k)

    monkeypatch.setattr(context.Context, "__init__", spy)
    main(["bench", str(TINY32), "-p", "0", "-n", "2", "-r", "1", "-t", "1", "-o", "json", "--no-warmup",
          "--probe-mib", "0", *flag])  # fmt: skip
    want = "f32" if flag else "q8"
    (r,) = json.loads(capsys.readouterr().out)
    assert r["cpu_matmul"] == want and modes and set(modes) == {want}


def test_bench_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["-o", "csv"], ["-p", "x"], ["-r", "0"], ["-p", "0", "-n", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(["bench", str(TINY32), *args])
        assert exc.value.code == 1
    assert capsys.readouterr().err.count("error: ") == 4


def test_bench_depth_and_cache_types(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """-d fills that many cells before each measured test (llama-bench's `tgN @ dD`); -ctk/-ctv sweep
    the cache types: positions of every decode call recorded, not just the labels."""
    from llamapy.context import Context

    calls: list[tuple[int, int, str]] = []
    real = Context.decode

    def spy(self: Context, tokens, positions, *a, **k):  # type: ignore[no-untyped-def]
        calls.append((int(positions[0]), len(positions), self.options.type_k.name.lower()))
        return real(self, tokens, positions, *a, **k)

    monkeypatch.setattr(Context, "decode", spy)
    main(["bench", str(TINY32), "-p", "4", "-n", "2", "-d", "0,8", "-ctk", "f16,q8_0", "-ctv", "f16", "-r", "1",
          "-t", "1", "--no-warmup", "-o", "json", "--probe-mib", "0"])  # fmt: skip
    res = json.loads(capsys.readouterr().out)
    got = [(r["type_k"], r["type_v"], r["n_depth"], r["n_prompt"], r["n_gen"]) for r in res]
    assert got == [(k, "f16", d, p, n) for k in ("f16", "q8_0") for d in (0, 8) for p, n in ((4, 0), (0, 2))]
    # per cache type: pp4, tg2, then history 8 + pp4 at 8, history 8 + tg2 at 8, 9
    want = [(0, 4), (0, 1), (1, 1), (0, 8), (8, 4), (0, 8), (8, 1), (9, 1)]
    assert [(p, n) for p, n, _ in calls] == want * 2
    assert [k for _, _, k in calls] == ["f16"] * 8 + ["q8_0"] * 8

    main(["bench", str(TINY32), "-p", "0", "-n", "2", "-d", "8", "-ctk", "q4_0", "-r", "1", "-t", "1", "--no-warmup",
          "--probe-mib", "0"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["model", "size", "params", "backend", "ngl", "threads", "type_k", "test", "t/s"]
    row = [c.strip() for c in lines[2].strip("|").split("|")]
    assert row[6] == "q4_0" and row[7] == "tg2 @ d8"

    with pytest.raises(SystemExit) as exc:
        main(["bench", str(TINY32), "-ctk", "q5_1"])
    assert exc.value.code == 1 and "error: -ctk q5_1" in capsys.readouterr().err
