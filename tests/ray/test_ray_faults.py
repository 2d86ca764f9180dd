"""Ray devices without a cluster (tests/ray/inprocess.py: the actors run in this process): they
are placed as GPUs (-ngl auto, -ot), a closed model leaves nothing mapped on the nodes, and a
device lost mid-run fails only what ran on it — the engine's running requests, the batch's
running prompts (no finished record lost), the server's requests (it stays up and says why)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llamapy.api import Llama
from llamapy.backend.registry import discover
from llamapy.context import ContextOptions, ModelOptions
from llamapy.engine import Engine, EngineStoppedError, Event, Request
from llamapy.model.sampler import SamplingParams
from llamapy.types import DeviceLostError

import inprocess
from tests_support import cli

CO = ContextOptions(n_ctx=512, n_batch=64, n_ubatch=16)
TOKS = list(range(10, 30))


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    from conftest import write_llama_gguf

    return write_llama_gguf(tmp_path / "m.gguf", n_layer=4)


@pytest.fixture()
def cpu_logits(model: Path, monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    monkeypatch.setenv("LLAMAPY_BACKENDS", "cpu,ray")
    monkeypatch.delenv("LLAMAPY_RAY", raising=False)
    discover(refresh=True)
    with Llama(model, model_options=ModelOptions(n_gpu_layers=0), context_options=CO) as llm:
        return llm.logits(TOKS)


@pytest.fixture()
def devices(cpu_logits: np.ndarray, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """RAY0 and RAY1 in this process; RAY1 dies once `kill[0]` is set."""
    kill = [False]
    monkeypatch.setenv("LLAMAPY_RAY", "in-process")
    made = inprocess.install(monkeypatch.setattr, die=lambda n: kill[0])
    discover(refresh=True)
    yield made, kill
    monkeypatch.delenv("LLAMAPY_RAY")
    discover(refresh=True)


def _weight_buffers(llm: Llama) -> dict[str, set[str]]:
    """Device name -> the weights it holds."""
    out: dict[str, set[str]] = {}
    for b in llm.model.weights.buffers:
        out.setdefault(b.name, set()).update(t.name for t in b._store)
    return out


def test_ngl_auto_puts_layers_on_ray_devices_as_on_gpus(devices, cpu_logits: np.ndarray, model: Path) -> None:  # noqa: ANN001
    made, _ = devices
    with Llama(model, model_options=ModelOptions(n_gpu_layers="auto", tensor_split=[1, 1]), context_options=CO) as llm:
        assert llm.model.placement.n_gpu_layers == 5, llm.model.info.ngl_reason  # 4 layers + output: all fit
        assert "RAY0" in llm.model.info.ngl_reason and "RAY1" in llm.model.info.ngl_reason
        assert {"RAY0", "RAY1"} <= set(_weight_buffers(llm))
        assert np.array_equal(llm.logits(TOKS), cpu_logits)
    # memory a GPU would need for its driver (the margin) and no more: nothing fits, as on a GPU
    for d in made:
        d._buft.budget = 512 * 2**20
    with Llama(model, model_options=ModelOptions(n_gpu_layers="auto"), context_options=CO) as llm:
        assert llm.model.placement.n_gpu_layers == 0, llm.model.info.ngl_reason
        assert not {"RAY0", "RAY1"} & set(_weight_buffers(llm))


def test_override_tensor_places_weights_on_a_ray_device(devices, cpu_logits: np.ndarray, model: Path) -> None:  # noqa: ANN001
    mo = ModelOptions(n_gpu_layers=0, override_tensor=[(r"blk\.1\.", "RAY1")])
    with Llama(model, model_options=mo, context_options=CO) as llm:
        where = _weight_buffers(llm)
        assert "RAY0" not in where and where["RAY1"] and all(n.startswith("blk.1.") for n in where["RAY1"]), where
        assert np.array_equal(llm.logits(TOKS), cpu_logits)


def test_closing_the_model_unmaps_the_file_on_the_nodes(devices, model: Path) -> None:  # noqa: ANN001
    made, _ = devices
    llm = Llama(model, model_options=ModelOptions(n_gpu_layers="all", tensor_split=[1, 1]), context_options=CO)
    actors = [d.actor().actor for d in made]
    files = [gf for a in actors for gf in a.files.values()]
    assert len(files) == 2 and all(a.buffers for a in actors)
    llm.close()
    assert all(not a.files and not a.buffers and not a.tensors and not a.graphs for a in actors)
    assert all(gf._closed for gf in files)


def test_a_split_model_is_refused_on_ray_devices(devices, model: Path, tmp_path: Path) -> None:  # noqa: ANN001
    """Remote devices read weights from one file they hold: a split model says so in one line
    (merged by llama-gguf-split it runs)."""
    from tests_support import split_gguf

    from llamapy.types import LlamapyError

    first = split_gguf(model, tmp_path / "s", 2)[0]
    with pytest.raises(LlamapyError, match=r"^RAY0: s-00001-of-00002.gguf is split in 2 files; remote devices load "
                                           r"weights from one file \(merge it with llama-gguf-split --merge\)$"):  # fmt: skip
        Llama(first, model_options=ModelOptions(n_gpu_layers="all"), context_options=CO)


def test_lora_pairs_on_ray_devices(devices, model: Path, tmp_path: Path) -> None:  # noqa: ANN001
    """A LoRA adapter's pairs go to the Ray device of the matrix each adapts (the node is sent
    the adapter file as it is the model's) and the logits are the CPU's, bit for bit."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from family_models import write_lora_gguf

    ad = write_lora_gguf(model, tmp_path / "a.gguf", (r"blk\.\d+\.(attn_q|ffn_down)\.weight", "output.weight"))
    logits = {}
    for ngl in (0, "all"):
        mo = ModelOptions(n_gpu_layers=ngl, tensor_split=[1, 1], lora=[(str(ad), 0.5)])
        with Llama(model, model_options=mo, context_options=CO) as llm:
            held = {b.name for a in llm.model.adapters for b in a.buffers}
            logits[ngl] = llm.logits(TOKS)
        assert held == ({"CPU"} if ngl == 0 else {"RAY0", "RAY1"})
    assert np.array_equal(logits[0], logits["all"])


def test_control_vector_is_refused_on_ray_devices(devices, model: Path, tmp_path: Path) -> None:  # noqa: ANN001
    """A node loads weights from a file it holds; a control vector's summed directions are in
    none, so a layer of it on a Ray device is refused in one line."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from family_models import write_control_vector

    from llamapy.types import LlamapyError

    cv = write_control_vector(tmp_path / "cv.gguf", 256, (1, 2))
    mo = ModelOptions(n_gpu_layers="all", control_vectors=[(str(cv), 1.0)])
    with pytest.raises(LlamapyError, match=r"^RAY\d: cvec\.\d is not read from the model file; remote devices load weights from it$"):
        Llama(model, model_options=mo, context_options=CO)


def test_a_lost_device_fails_the_running_requests_and_refuses_later_ones(
    devices, cpu_logits: np.ndarray, model: Path  # noqa: ANN001
) -> None:
    made, kill = devices
    mo = ModelOptions(n_gpu_layers="all", tensor_split=[1, 1])
    llm = Llama(model, model_options=mo, context_options=CO)
    engine = Engine(llm.ctx, n_parallel=2)
    evs: list[Event] = []
    req = Request(TOKS, max_tokens=50, sampling=SamplingParams(temp=0, ignore_eos=True))
    for _ in range(2):
        engine.submit(req, evs.append)
    for _ in range(3):
        engine.step()
    assert sum(e.kind == "token" for e in evs) >= 4 and not any(e.kind == "done" for e in evs)
    kill[0] = True
    engine.step()
    done = [e for e in evs if e.kind == "done"]
    assert len(done) == 2 and all(e.finish_reason == "error" for e in done)
    assert all(e.error is not None and e.error.startswith("RAY1: device lost (compute)") for e in done), done
    assert engine.fault is not None and engine.fault.startswith("RAY1: device lost")
    with pytest.raises(EngineStoppedError, match="the model is unavailable: RAY1: device lost"):
        engine.submit(req, evs.append)
    # a later load starts afresh (a new actor on RAY1), and the old context cannot reach it
    with Llama(model, model_options=mo, context_options=CO) as again:
        assert np.array_equal(again.logits(TOKS), cpu_logits)
        with pytest.raises(DeviceLostError, match=r"RAY1: device lost .*\(load the model again\)"):
            llm.logits(TOKS)
    engine.close()
    llm.close()


def test_run_batch_yields_every_finished_record_then_names_the_lost_device(devices, model: Path) -> None:  # noqa: ANN001
    from llamapy.batch import BatchFailed, BatchRequest, run_batch

    made, kill = devices
    with Llama(model, model_options=ModelOptions(n_gpu_layers="all", tensor_split=[1, 1]), context_options=CO) as llm:
        reqs = [BatchRequest(TOKS[: 5 + i], n_predict=2 if i % 2 == 0 else 100) for i in range(4)]
        got = []
        sp = SamplingParams(temp=0, ignore_eos=True)
        with pytest.raises(BatchFailed) as e:
            for rec in run_batch(llm.ctx, reqs, n_parallel=2, sampling=sp):
                got.append(rec.index)
                if rec.index == 2:  # 0 and 2 are done, 1 and 3 still running
                    kill[0] = True
        assert sorted(got) == [0, 2]
        assert e.value.running == [1, 3] and str(e.value).startswith("RAY1: device lost (compute)")
        assert str(e.value).endswith("(prompts 1, 3 running)")


PROMPTS = [("the cat", 2), ("once upon a time", 300), ("in the", 2), ("she said", 300)]


def test_cli_batch_writes_every_finished_record_and_resumes(model: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "n_predict": n}) + "\n" for p, n in PROMPTS))
    flags = ["batch", str(model), str(prompts), "-np", "2", "-c", "1024", "--temp", "0", "--ignore-eos",
             "--no-progress"]  # fmt: skip
    base = tmp_path / "cpu.jsonl"
    r = cli(*flags, "-o", str(base), "-ngl", "0", env={"LLAMAPY_BACKENDS": "cpu"})
    assert r.returncode == 0, r.stderr
    want = {d["index"]: d["text"] for d in map(json.loads, base.read_text().splitlines())}
    out = tmp_path / "ray.jsonl"
    ray = [sys.executable, "-c", inprocess.SCRIPT, *flags, "-o", str(out), "--ray", "in-process", "-ngl", "all",
           "-ts", "1,1"]  # fmt: skip
    env = dict(os.environ, LLAMAPY_BACKENDS="cpu,ray", LLAMAPY_FAKE_RAY_DIE_AFTER="30")
    env.pop("LLAMAPY_DEBUG", None)
    r = subprocess.run(ray, capture_output=True, text=True, env=env, timeout=300)
    text = r.stderr.strip()
    assert r.returncode == 1 and "Traceback" not in text, text[-3000:]
    assert text.splitlines()[-1] == (
        f"error: batch: RAY1: device lost (compute): the node died (simulated) (prompts 1, 3 running); "
        f"2 records written to {out}; rerun with -o {out} to resume"
    ), text[-3000:]
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    # 2 finished while 1 still ran: it waited in memory for 1, and is written, not lost
    assert [d["index"] for d in recs] == [0, 2] and all(d["text"] == want[d["index"]] for d in recs)
    env.pop("LLAMAPY_FAKE_RAY_DIE_AFTER")
    r = subprocess.run(ray, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert sorted(d["index"] for d in recs) == [0, 1, 2, 3]
    assert {d["index"]: d["text"] for d in recs} == want


def test_serve_fails_the_requests_on_a_lost_device_and_stays_up(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from conftest import write_llama_gguf
    from serving import CHAT_TEMPLATE, Server

    model = write_llama_gguf(tmp_path / "chat.gguf", n_layer=4, seed=5, chat_template=CHAT_TEMPLATE)
    die = tmp_path / "die"
    s = Server(model, ["-np", "2", "-c", "4096", "--ray", "in-process", "-ngl", "all", "-ts", "1,1", "-t", "1"],
               tmp_path / "server.log", cli=[sys.executable, "-c", inprocess.SCRIPT],
               env={"LLAMAPY_BACKENDS": "cpu,ray", "LLAMAPY_FAKE_RAY_DIE_FILE": str(die)})  # fmt: skip
    try:
        assert "RAY1 model buffer" in s.text()
        body = {"prompt": "the cat", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
        datas = []
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    datas.append(line[6:])
                    if len(datas) == 3:
                        die.touch()  # RAY1's node dies mid-generation
        errors = [json.loads(d)["error"] for d in datas if d != "[DONE]" and "error" in json.loads(d)]
        assert len(errors) == 1 and errors[0]["message"].startswith("RAY1: device lost (compute)"), datas[-3:]
        # the server stays up and says why it cannot generate
        assert s.proc.poll() is None
        h = httpx.get(s.url + "/health", timeout=10)
        assert h.status_code == 503 and "RAY1: device lost" in h.json()["error"]["message"], h.text
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "the model is unavailable: RAY1: device lost" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/slots", timeout=10).status_code == 200
    finally:
        s.stop()
