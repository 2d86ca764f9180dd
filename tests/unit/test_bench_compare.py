"""bench/compare.py, bench/models1b.py (issue 11 item 7) and bench/models_moe.py (issue 29)
without measuring anything: the CPU flags every output names, the per-type selection and file
cache, the 1B and MoE shapes' rows and bars, and the per-type table's computed columns."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests_support import bench_module as _load


def test_cpu_flags_name_the_simd_extensions() -> None:
    cmp = _load("compare")
    intel = "processor\t: 0\nflags\t\t: fpu sse avx2 fma avx512f avx512_vnni amx_tile amx_int8 ht\n"
    assert cmp.cpu_flags(intel) == ["avx2", "fma", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"]
    assert cmp.cpu_flags("Features\t: fp asimd asimddp\n") == ["asimd", "asimddp"]
    mach = {"cpu": "Some CPU", "flags": ["avx2", "fma"], "cores": 2, "loadavg": (0.5, 0, 0)}
    assert "flags: avx2 fma" in cmp.machine_line(mach) and "Some CPU" in cmp.machine_line(mach)


def test_parse_types() -> None:
    m = _load("models1b")
    assert m.parse_types("all") == list(m.PURE_TYPES) and "F32" not in m.parse_types("all")
    assert len(m.PURE_TYPES) == 12
    assert m.parse_types("q4_0, Q4_K,q4_0,f32") == ["Q4_0", "Q4_K", "F32"]
    for bad in ("q4_k_m", "", "q9"):
        with pytest.raises(ValueError):
            m.parse_types(bad)


def test_model_paths_options_then_environment_then_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _load("models1b")
    for k in ("LLAMAPY_BENCH_MODELS", "LLAMAPY_LLAMA1B", "LLAMAPY_LLAMA1B_F16"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LLAMAPY_BENCH_CACHE", str(tmp_path / "cache"))
    p = m.paths()
    assert p.folder == tmp_path / "cache" / "models" and p.q4_k_m == p.folder / "llama1b-Q4_K_M.gguf"
    assert p.pure("Q8_0") == p.folder / "llama1b-pure-Q8_0.gguf" and p.pure("F16") == p.f16
    monkeypatch.setenv("LLAMAPY_LLAMA1B", str(tmp_path / "env.gguf"))
    assert m.paths().q4_k_m == tmp_path / "env.gguf"
    assert m.paths(llama1b=str(tmp_path / "opt.gguf")).q4_k_m == tmp_path / "opt.gguf"


def test_files_are_made_once_and_never_half(tmp_path: Path) -> None:
    """ensure_file runs the quantizer only for a missing file, through a temporary name."""
    m = _load("models1b")
    p = m.Paths(tmp_path, tmp_path / "q4km.gguf", tmp_path / "f16.gguf")
    p.f16.write_bytes(b"f16")
    calls = tmp_path / "calls"
    tool = tmp_path / "fake-quantize"  # writes its OUT argument, logs its arguments
    tool.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                    'if [ "$1" = --pure ]; then echo q > "$3"; else echo q > "$2"; fi\n')  # fmt: skip
    tool.chmod(0o755)
    out = m.ensure_file(p, "Q4_0", tool)
    assert out == p.pure("Q4_0") and out.read_text() == "q\n"
    assert m.ensure_file(p, "Q4_0", tool) == out  # cached: no second call
    assert m.ensure_file(p, None, tool) == p.q4_k_m
    log = calls.read_text().splitlines()
    assert log == [f"--pure {p.f16} {out}.part Q4_0", f"{p.f16} {p.q4_k_m}.part Q4_K_M"]
    assert m.ensure_file(p, "F16", None) == p.f16  # the F16 source is the pure F16 file
    with pytest.raises(RuntimeError, match="llama-quantize"):
        m.ensure_file(p, "Q8_0", None)
    bad = tmp_path / "failing-quantize"
    bad.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    bad.chmod(0o755)
    with pytest.raises(RuntimeError, match="broken"):
        m.ensure_file(p, "Q5_0", bad)
    assert not list(tmp_path.glob("*.part")) and not p.pure("Q5_0").exists()


def test_the_1b_rows_use_tg64_and_issue_11_bars() -> None:
    cmp = _load("compare")
    res = {"model": "llama1b-Q4_K_M", "kind": "llama1b", "n_gen": 64,
           "llamapy": {"tg64_tps": 9.0, "pp512_tps": 120.0, "run": {"max_rss_kib": 1024 * 800}},
           "llama.cpp": {"tg64_tps": 10.0, "pp512_tps": 100.0, "completion": {"max_rss_kib": 1024 * 1000},
                         "source": "measured in this run"}}  # fmt: skip
    rows = {r[1]: r for r in cmp.rows_for(res)}
    tg = rows["generation tg64 (tok/s)"]
    assert tg[4] == "0.90×" and tg[5].startswith("≥ 1×") and tg[6] == "BELOW FLOOR"
    assert rows["prompt pp512 (tok/s)"][6] == "ok (floor met)"  # 1.2× ≥ 1.2×
    assert rows["peak RSS, run -n 64 -c 512 (MiB)"][6] == "ok (floor met)"  # 0.8× ≤ 1×
    assert rows[next(k for k in rows if k.startswith("load"))][5] == "none (reported)"
    # the "apart" table: llamapy's effective bandwidth and llama.cpp's over the same bytes
    res["llamapy"].update(weight_bytes_per_token=500_000_000, eff_bw_gbs=4.5, bw_fraction=0.5)
    apart = cmp.markdown([res]).split("Apart (llamapy):")[1].strip().splitlines()
    assert apart[0].rstrip(" |").endswith("weights a token (MB) | tg eff GB/s: llamapy (of its probe) | llama.cpp")
    assert apart[2].rstrip(" |").endswith("| 500.0 | 4.50 (50 %) | 5.00")


def test_moe_files_are_written_quantized_and_measured_on_issue_29_bars(tmp_path: Path) -> None:
    """models_moe: the F16 source from the writer, then llama-quantize to the shipped type, once;
    compare: the MoE rows are tg64 with bars of 1.0x on tg and pp."""
    m = _load("models_moe")
    assert {f.qtype for f in m.FILES.values()} == {"Q4_K_M", "MXFP4_MOE"}
    f = m.FILES["gptoss6"]
    f.f16(tmp_path).write_bytes(b"f16")  # as if written: no 11 GB file in a unit test
    calls = tmp_path / "calls"
    tool = tmp_path / "fake-quantize"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho q > "$2"\n')
    tool.chmod(0o755)
    out = m.ensure_file(f, tmp_path, tool, keep_f16=True)
    assert out == tmp_path / "gptoss6-MXFP4_MOE.gguf" and m.ensure_file(f, tmp_path, tool) == out
    assert calls.read_text().splitlines() == [f"{f.f16(tmp_path)} {out}.part MXFP4_MOE"]
    with pytest.raises(RuntimeError, match="llama-quantize"):
        m.ensure_file(m.FILES["qwen3moe8"], tmp_path, None)
    cmp = _load("compare")
    res = {"model": "qwen3moe8-Q4_K_M", "kind": "qwen3moe8", "n_gen": 64,
           "llamapy": {"tg64_tps": 9.9, "pp512_tps": 100.0}, "llama.cpp": {"tg64_tps": 10.0, "pp512_tps": 100.0}}  # fmt: skip
    rows = {r[1]: r for r in cmp.rows_for(res)}
    assert rows["generation tg64 (tok/s)"][6] == "BELOW FLOOR" and rows["prompt pp512 (tok/s)"][6] == "ok (floor met)"
    assert "qwen3moe8" in cmp.N_GEN_64 and "gptoss6" in cmp.N_GEN_64


def test_per_type_table_columns() -> None:
    cmp = _load("compare")
    rows = [
        {"type": "Q8_0", "file_bytes": 1300 << 20, "n_gen": 16, "llamapy": 4.5, "llama.cpp": 5.0,
         "weight_bytes_per_token": 1_000_000_000, "eff_bw_gbs": 4.5, "bw_fraction": 0.25},
        {"type": "Q4_0", "file_bytes": 700 << 20, "n_gen": 16, "llamapy": 8.0, "llama.cpp": None},
    ]  # fmt: skip
    lines = cmp.per_type_markdown(rows).splitlines()
    assert "llamapy tg16" in lines[0] and "bar ≥ 0.9×" in lines[0]
    q8 = [c.strip() for c in lines[2].strip("|").split("|")]
    assert q8 == ["Q8_0", "1300", "1000.0", "4.50", "5.00", "0.90×", "met", "4.50 (25 %)", "5.00"]
    q4 = [c.strip() for c in lines[3].strip("|").split("|")]
    assert q4[5:7] == ["n/a", "n/a"] and q4[8] == "n/a"


def test_bandwidth_fields_come_from_the_tg_record() -> None:
    cmp = _load("compare")
    recs = [{"n_prompt": 512, "n_gen": 0, "eff_bw_gbs": None},
            {"n_prompt": 0, "n_gen": 64, "eff_bw_gbs": 7.5, "bw_fraction": 0.5, "weight_bytes_per_token": 10}]  # fmt: skip
    assert cmp.bandwidth(recs) == {"eff_bw_gbs": 7.5, "bw_fraction": 0.5, "weight_bytes_per_token": 10}
    assert cmp.bandwidth(recs[:1]) == {}


def test_depth_table_rows_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The history table: llama-bench and llamapy bench get the same -d/-ctk/-ctv, ratio vs 1.0×."""
    cmp = _load("compare")
    seen: list[list[str]] = []

    def fake_bench(tools, model, p, n, t, reps, extra, timeout):  # type: ignore[no-untyped-def]
        seen.append(["llama-bench", "-p", str(p), "-n", str(n), *extra])
        return [{"n_prompt": 0, "n_gen": n, "avg_ts": 50.0}]

    class Child:
        rc, stderr = 0, ""
        stdout = '[{"n_prompt": 0, "n_gen": 128, "avg_ts": 55.0}]'

    def fake_child(cmd, env=None, timeout=None):  # type: ignore[no-untyped-def]
        seen.append(list(cmd))
        return Child()

    monkeypatch.setattr(cmp.llama_cpp, "run_bench", fake_bench)
    monkeypatch.setattr(cmp.llama_cpp, "run_child", fake_child)
    r = cmp.at_depth(Path("m.gguf"), 2048, "q8_0", {"llama-bench": Path("x")}, 2, 1, 128, None)
    assert r["llamapy"] == 55.0 and r["llama.cpp"] == 50.0
    flags = ["-d", "2048", "-ctk", "q8_0", "-ctv", "q8_0"]
    assert seen[0][-6:] == flags and seen[1][-6:] == flags and "bench" in seen[1]
    lines = cmp.depth_markdown([r, {**r, "cache_type": "q4_0", "llama.cpp": 60.0}]).splitlines()
    assert [c.strip() for c in lines[2].strip("|").split("|")][1:] == \
        ["q8_0", "tg128 @ d2048", "55.00", "50.00", "1.10×", "met"]
    assert lines[3].rstrip(" |").endswith("NOT MET")


def test_alternating_rounds_take_medians_in_turn() -> None:
    cmp = _load("compare")
    calls: list[str] = []
    lc_tg, lp_tg = [100.0, 50.0, 90.0], [120.0, 40.0, 99.0]  # round 1: a slow phase of the host

    def lc(i: int) -> dict:
        calls.append(f"lc{i}")
        return {"tg64_tps": lc_tg[i], "source": "measured", **({"completion": {"x": 1}} if i == 0 else {})}

    def lp(i: int) -> dict:
        calls.append(f"lp{i}")
        return {"tg64_tps": lp_tg[i], "via": "llamapy bench"}

    a, b, ratios = cmp.alternate(3, lc, lp)
    assert calls == ["lc0", "lp0", "lc1", "lp1", "lc2", "lp2"]
    assert a == {"tg64_tps": 90.0, "source": "measured", "completion": {"x": 1}}
    assert b == {"tg64_tps": 99.0, "via": "llamapy bench"}
    assert [round(r["tg64_tps"], 3) for r in ratios] == [1.2, 0.8, 1.1]
    assert cmp._spread(ratios, "tg64_tps") == " (0.80–1.20)" and cmp._spread(ratios[:1], "tg64_tps") == ""
