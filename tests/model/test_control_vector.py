"""Control vectors (llamapy/model/control_vector.py, layers.cvec): files summed by strength, the
layer range, the TEST device, the CLI's flags and log, what a bad file is told, and (slow)
llama.cpp's own --control-vector-scaled run of the same files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import llamapy
from llamapy.context import ContextOptions, ModelOptions
from llamapy.types import LlamapyError
from family_models import rewrite_gguf, write_control_vector, write_family_gguf
from tests_support import cli

TOKENS = [1, 260, 40, 75, 262, 100, 101, 263, 7, 8]
CO = ContextOptions(n_ctx=64, cpu_matmul="f32")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    d = tmp_path_factory.mktemp("cvec")
    model = write_family_gguf(d / "m.gguf", "qwen3", tied=False, n_layer=3)
    return model, write_control_vector(d / "a.gguf", 128, (1, 2, 5), gain=0.5), write_control_vector(d / "b.gguf", 128, (2,), seed=1)


def _run(model: Path, ngl: int | str = 0, **kw: object) -> tuple[np.ndarray, object]:
    with llamapy.Llama(model, model_options=ModelOptions(n_gpu_layers=ngl, **kw), context_options=CO) as llm:  # type: ignore[arg-type]
        return llm.logits(TOKENS), llm.model.control_vector


def test_strengths_add_up_and_the_range_selects_layers(files: tuple[Path, Path, Path]) -> None:
    model, a, b = files
    base, _ = _run(model)
    one, cv = _run(model, control_vectors=[(str(a), 1.0)])
    assert sorted(cv.directions) == [1, 2] and cv.beyond == [5]  # type: ignore[attr-defined]
    assert np.abs(one - base).max() > 0.1
    halves, _ = _run(model, control_vectors=[(str(a), 0.5), (str(a), 0.5)])
    assert np.array_equal(halves, one)  # 0.5·d + 0.5·d = d, exactly
    both, _ = _run(model, control_vectors=[(str(a), 1.0), (str(b), -2.0)])
    assert not np.allclose(both, one)
    only2, cv2 = _run(model, control_vectors=[(str(a), 1.0)], control_vector_layers=(2, 2))
    assert sorted(cv2.directions) == [2]  # type: ignore[attr-defined]
    assert not np.allclose(only2, one) and not np.allclose(only2, base)
    none, cv0 = _run(model, control_vectors=[(str(b), 1.0)], control_vector_layers=(1, 1))
    assert not cv0.directions and np.array_equal(none, base)  # type: ignore[attr-defined]


def test_on_the_test_device(files: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model, a, _ = files
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.delenv("LLAMAPY_TEST_GPU_MEM", raising=False)
    cpu, _ = _run(model, control_vectors=[(str(a), 1.0)])
    for ngl in (2, "all"):
        with llamapy.Llama(model, model_options=ModelOptions(n_gpu_layers=ngl, control_vectors=[(str(a), 1.0)]), context_options=CO) as llm:
            held = {t.name: b.name for b in llm.model.control_vector.buffers for t in b._store}  # type: ignore[union-attr]
            got = llm.logits(TOKENS)
        assert held == {"cvec.1": "CPU" if ngl == 2 else "TEST0", "cvec.2": "TEST0"}
        # (the CPU's F32 products run its float kernels, the test device's numpy's sgemm: float32
        # sums in two orders)
        assert np.abs(got - cpu).max() <= 1e-4 * np.abs(cpu).max()


def _bad(d: Path, case: str) -> Path:
    good = write_control_vector(d / "good.gguf", 128, (1,))
    r = np.random.default_rng(0).standard_normal
    add = {"zero": {"direction.0": r(128)}, "name": {"dir.1": r(128)}, "size": {"direction.2": r(64)},
           "shape": {"direction.2": r((2, 128))}}[case]  # fmt: skip
    return rewrite_gguf(good, d / "bad.gguf", add_tensors=add)


BAD = {
    "zero": r"control vector bad.gguf: tensor 'direction.0' is not direction.N with a layer N >= 1",
    "name": r"control vector bad.gguf: tensor 'dir.1' is not direction.N with a layer N >= 1",
    "size": r"control vector bad.gguf: 'direction.2' has 64 values, the model's n_embd is 128",
    "shape": r"control vector bad.gguf: 'direction.2' is F32 \[128, 2\], expected a 1-D F32 vector",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_files_are_refused_in_one_line(tmp_path: Path, files: tuple[Path, Path, Path], case: str) -> None:
    with pytest.raises(LlamapyError, match=BAD[case]) as e:
        llamapy.Llama(files[0], model_options=ModelOptions(control_vectors=[(str(_bad(tmp_path, case)), 1.0)]))
    assert "\n" not in str(e.value)


def test_cli_flags_and_log(files: tuple[Path, Path, Path]) -> None:
    model, a, b = files
    args = ["-p", "abc", "-n", "8", "--temp", "0", "-c", "64"]
    base = cli("run", str(model), *args)
    one = cli("run", str(model), "--control-vector", str(a), *args)
    scaled = cli("run", str(model), "--control-vector-scaled", f"{a}:0.5,{a}:0.5", *args)
    ranged = cli("run", str(model), "--control-vector", f"{a},{b}", "--control-vector-layer-range", "2", "3", *args)
    for r in (base, one, scaled, ranged):
        assert r.returncode == 0, r.stderr[-1500:]
    assert one.stdout == scaled.stdout != base.stdout
    assert "llama_adapter_cvec: control vector on layers 1, 2 (range 1-3)" in one.stderr
    assert "llama_adapter_cvec: directions for layers 5 not applied: the model has 3 (as llama.cpp)" in one.stderr
    assert "llama_adapter_cvec: control vector on layers 2 (range 2-3)" in ranged.stderr
    for flags, message in ((["--control-vector-scaled", str(a)], f"error: --control-vector-scaled {a}: expected FNAME:SCALE"),
                           (["--control-vector", str(a), "--control-vector-layer-range", "3", "2"],
                            "error: --control-vector-layer-range 3 2: the start is past the end")):  # fmt: skip
        r = cli("run", str(model), *flags, *args)
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [message], r.stderr


@pytest.mark.slow
def test_against_llama_cpp_control_vectors(tmp_path: Path) -> None:
    """llama-perplexity with two control vectors (one negative), layers 1-2 of 3: llamapy's float32
    run of the same files against llama.cpp's logits, mean KLD <= 1e-5; without them it fails."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent / "references"))
    import make_family_refs as refs

    model = write_family_gguf(tmp_path / "m.gguf", "qwen3", n_layer=3, n_embd=256, n_ff=512, head_dim=64, tied=False,
                              vocab=refs.QWEN2_VOCAB, embd_scale=0.3, seed=32)  # fmt: skip
    a = write_control_vector(tmp_path / "a.gguf", 256, (1, 2, 7), gain=0.3, seed=3)
    b = write_control_vector(tmp_path / "b.gguf", 256, (2,), gain=0.3, seed=4)
    flags = ["--control-vector-scaled", f"{a}:0.8,{b}:-1.5", "--control-vector-layer-range", "1", "2"]
    mo = ModelOptions(control_vectors=[(str(a), 0.8), (str(b), -1.5)], control_vector_layers=(1, 2))
    (kld, _), (kld0, _) = refs.kld_with_flags(model, flags, [mo, ModelOptions()], tmp_path)
    print(f"llamapy with the control vectors against llama.cpp with them: mean KLD {kld:.3g}; without: {kld0:.3g}")
    assert kld <= 1e-5 and kld0 > 0.01
