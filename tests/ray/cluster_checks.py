"""Checks of the Ray devices on one simulated cluster (a head and two nodes offering
{"llamapy": 1}), run by test_ray.py inside a loopback-only network namespace — never directly
(the name keeps pytest from collecting it). The node kills come last: the first leaves one node;
the batch check adds one back, then kills one."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests_support import cli, shared

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PROMPT = "Once upon a time"


@pytest.fixture(scope="session")
def ray_cluster():  # noqa: ANN201 - ray.cluster_utils.Cluster
    if os.environ.get("LLAMAPY_RAY_INNER") != "1" or [n for _, n in socket.if_nameindex()] != ["lo"]:
        pytest.fail("run through tests/ray/test_ray.py (a loopback-only network namespace)")
    # node-side caches in scratch folders (the nodes inherit this environment)
    os.environ["LLAMAPY_RAY_CACHE"] = tempfile.mkdtemp(prefix="llamapy-ray-models-")
    import cluster

    c = cluster.start(2)
    yield c
    c.shutdown()


@pytest.fixture(scope="session")
def address(ray_cluster) -> str:  # noqa: ANN001
    return ray_cluster.address


@pytest.fixture(scope="session")
def tiny() -> Path:
    return shared("reference", "tiny32", "tiny32-Q4_K_M.gguf")


def _run(model: Path, *flags: str, n: int = 24, env: dict[str, str] | None = None):  # noqa: ANN202
    return cli("run", str(model), "-p", PROMPT, "-n", str(n), "--temp", "0", "-c", "512", *flags, env=env, timeout=600)


def test_devices_listed_with_self_test(address: str) -> None:
    r = cli("devices", "--ray", address, timeout=300)
    assert r.returncode == 0, r.stderr
    for name in ("RAY0", "RAY1"):
        line = next((ln for ln in r.stdout.splitlines() if ln.strip().startswith(name)), "")
        assert " GPU " in line and line.rstrip().endswith("PASS"), r.stdout
    assert "RAY2" not in r.stdout  # the head offers no `llamapy`: no device


def test_a_driver_without_the_cluster_token_is_refused(address: str) -> None:
    r = cli("run", "-p", "hi", "-n", "1", "--ray", address, env={"RAY_AUTH_TOKEN": "0" * 64}, timeout=300)
    text = r.stderr.strip()
    assert r.returncode != 0 and "Traceback" not in text, text[-2000:]
    assert text.splitlines()[-1].startswith(f"error: --ray {address}: "), text[-2000:]


def test_a_device_that_does_not_answer_in_time_is_one_line(address: str, tiny: Path) -> None:
    # so short a timeout ends the connect or a node's first call: either way one error line
    r = _run(tiny, "--ray", address, "-ngl", "all", env={"LLAMAPY_RAY_TIMEOUT": "0.001"})
    text = r.stderr.strip()
    assert r.returncode != 0 and "Traceback" not in text, text[-2000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and re.match(r"error: (RAY0|--ray \S+): no (answer|cluster answered) within 0\.001 s",
                                         errors[0]), text[-2000:]  # fmt: skip


def test_an_address_where_no_cluster_answers_is_one_line_within_the_timeout(address: str, tiny: Path) -> None:
    t0 = time.monotonic()
    r = _run(tiny, "--ray", "127.0.0.1:1", env={"LLAMAPY_RAY_TIMEOUT": "5"})
    text = r.stderr.strip()
    assert r.returncode != 0 and "Traceback" not in text, text[-2000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error: ")]
    assert errors == ["error: --ray 127.0.0.1:1: no cluster answered within 5 s (set LLAMAPY_RAY_TIMEOUT to wait longer)"], text
    assert time.monotonic() - t0 < 60


def test_greedy_text_on_two_remote_devices_equals_cpu(address: str, tiny: Path) -> None:
    cpu = _run(tiny, "-ngl", "0")
    ray = _run(tiny, "--ray", address, "-ngl", "all", "-ts", "1,1")
    assert cpu.returncode == 0 and ray.returncode == 0, cpu.stderr + ray.stderr
    assert "RAY0 model buffer" in ray.stderr and "RAY1 model buffer" in ray.stderr, ray.stderr
    assert "RAY0 KV buffer" in ray.stderr and "RAY1 KV buffer" in ray.stderr, ray.stderr
    assert ray.stdout == cpu.stdout and len(cpu.stdout.strip()) > 10


def test_ngl_10_on_one_remote_device_equals_cpu(address: str, tiny: Path) -> None:
    cpu = _run(tiny, "-ngl", "0")
    ray = _run(tiny, "--ray", address, "-dev", "RAY0", "-ngl", "10")
    assert ray.returncode == 0, ray.stderr
    assert "offloaded 10/33 layers" in ray.stderr and "RAY1" not in ray.stderr, ray.stderr
    assert ray.stdout == cpu.stdout


def test_ngl_auto_and_override_tensor_treat_remote_devices_as_gpus(address: str, tiny: Path) -> None:
    cpu = _run(tiny, "-ngl", "0")
    auto = _run(tiny, "--ray", address, "-ngl", "auto")
    assert auto.returncode == 0, auto.stderr[-2000:]
    # as many layers as the nodes' free memory holds, less a GPU's margin (this machine is shared:
    # not necessarily all of them)
    m = re.search(r"-ngl auto: (\d+)/33 layers fit the free GPU memory \(margin: RAY0 \d+ MiB, RAY1 \d+ MiB\)",
                  auto.stderr)  # fmt: skip
    assert m and int(m.group(1)) > 0, auto.stderr[-2000:]
    assert re.search(r"RAY[01] model buffer", auto.stderr), auto.stderr[-2000:]
    # -ot: layers 16.. on RAY1 although -ngl 0 keeps every layer on the CPU
    ot = _run(tiny, "--ray", address, "-ngl", "0", "-ot", r"blk\.(1[6-9]|2[0-9]|3[01])\.=RAY1")
    assert ot.returncode == 0, ot.stderr[-2000:]
    assert "RAY1 model buffer" in ot.stderr and "RAY0 model buffer" not in ot.stderr, ot.stderr[-2000:]
    assert auto.stdout == cpu.stdout and ot.stdout == cpu.stdout


def test_serve_with_ray_flag(address: str, tiny: Path, tmp_path: Path) -> None:
    import httpx

    sys.path.insert(0, str(HERE.parent / "server"))
    from serving import Server

    s = Server(tiny, ["-np", "1", "-c", "512", "--ray", address, "-ngl", "all", "-ts", "1,1"], tmp_path / "server.log",
               ready_s=300)  # fmt: skip
    try:
        assert "RAY0 model buffer" in s.text() and "RAY1 model buffer" in s.text(), s.text()[-2000:]
        r = httpx.post(s.url + "/completion", json={"prompt": PROMPT, "n_predict": 24, "temperature": 0}, timeout=300)
        assert r.status_code == 200, r.text
        got = r.json()["content"]
    finally:
        s.stop()
    assert got.strip() and got in _run(tiny, "-ngl", "0").stdout


def _kld(stdout: str) -> tuple[float, float, float]:
    ppl = float(re.search(r"^Mean PPL\(Q\) *: +([0-9.]+)", stdout, re.M).group(1))  # type: ignore[union-attr]
    kld = float(re.search(r"^Mean    KLD: +(-?[0-9.]+) ±", stdout, re.M).group(1))  # type: ignore[union-attr]
    same = float(re.search(r"^Same top p: +([0-9.]+) ±", stdout, re.M).group(1))  # type: ignore[union-attr]
    return ppl, kld, same


def test_perplexity_logits_across_remote_devices_equal_cpu(address: str, tiny: Path) -> None:
    base = shared("reference", "tiny32", "tiny32-Q4_K_M-f32.c128x2.kld")
    args = ["perplexity", str(tiny), "--kl-divergence-base", str(base), "--kl-divergence", "-b", "128", "-ub", "32"]
    # without BLAS: a remote node computes with its CPU backend alone, so the local run does too
    env = {"LLAMAPY_BACKENDS": "cpu,ray"}
    cpu = cli(*args, "-ngl", "0", env=env, timeout=600)
    ray = cli(*args, "--ray", address, "-ngl", "all", "-ts", "1,1", env=env, timeout=600)
    assert cpu.returncode == 0 and ray.returncode == 0, cpu.stderr[-2000:] + ray.stderr[-2000:]
    assert "RAY1 model buffer" in ray.stderr
    # the same logits, so the same figures against llama.cpp's base, to every digit printed
    assert _kld(ray.stdout) == _kld(cpu.stdout)


def test_batch_over_two_remote_devices_equals_cpu(address: str, tiny: Path, tmp_path: Path) -> None:
    import json

    prompts = tmp_path / "p.txt"
    prompts.write_text("the cat\nOnce upon a time\nin the\nshe said\n")
    texts = []
    for i, flags in enumerate((["-ngl", "0"], ["--ray", address, "-ngl", "all", "-ts", "1,1"])):
        out = tmp_path / f"out{i}.jsonl"
        r = cli("batch", str(tiny), str(prompts), "-o", str(out), "-n", "8", "--temp", "0", "-np", "2", "-c", "256",
                "--no-progress", *flags, timeout=600)  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        recs = sorted((json.loads(ln) for ln in out.read_text().splitlines()), key=lambda d: d["index"])
        texts.append([d["text"] for d in recs])
    assert len(texts[0]) == 4 and texts[1] == texts[0]


LOAD_TWICE = r"""
import shutil, sys
from pathlib import Path
from llamapy.api import Llama
from llamapy.backend import ray as rb
from llamapy.backend.registry import discover
from llamapy.context import ModelOptions

src, tmp = Path(sys.argv[1]), Path(sys.argv[2])
orig = rb.RayBuffer.finish_loading

def absent_on_the_node(self):
    # the driver has mapped the file; removing it now leaves the nodes without it
    if self._gf is not None and Path(self._gf.path).exists():
        Path(self._gf.path).unlink()
    orig(self)

rb.RayBuffer.finish_loading = absent_on_the_node
for i in range(2):
    p = tmp / f"copy{i}.gguf"
    shutil.copyfile(src, p)
    llm = Llama(p, model_options=ModelOptions(n_gpu_layers="all", tensor_split=[1, 1]))
    out = llm.logits(llm.tokenize("Once upon a time"))
    sent = sum(d.file_bytes_sent for d in discover().devices() if isinstance(d, rb.RayDevice))
    print(f"load {i}: sent {sent} argmax {int(out[-1].argmax())}", flush=True)
    llm.close()
"""


def test_absent_file_is_sent_once_then_cached_on_the_node(address: str, tiny: Path, tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", LOAD_TWICE, str(tiny), str(tmp_path)], capture_output=True, text=True, timeout=600,
        env=dict(os.environ, LLAMAPY_RAY=address),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = re.findall(r"load (\d): sent (\d+) argmax (\d+)", r.stdout)
    assert len(lines) == 2, r.stdout
    size = tiny.stat().st_size
    # the first load sends the file once (the simulated nodes share one disk, so the second node
    # finds the copy the first one received); the second load finds it too: no more bytes
    assert int(lines[0][1]) == size and int(lines[1][1]) == size
    assert lines[0][2] == lines[1][2]


def test_default_model_on_two_remote_devices_equals_cpu(address: str, default_model: Path) -> None:
    cpu = _run(default_model, "-ngl", "0", n=16)
    ray = _run(default_model, "--ray", address, "-ngl", "all", "-ts", "1,1", n=16)
    assert cpu.returncode == 0 and ray.returncode == 0, cpu.stderr[-2000:] + ray.stderr[-2000:]
    assert ray.stdout == cpu.stdout


def test_killed_node_ends_the_run_with_one_line(ray_cluster, address: str, tiny: Path) -> None:  # noqa: ANN001
    env = dict(os.environ, LLAMAPY_RAY_TIMEOUT="30")
    env.pop("LLAMAPY_DEBUG", None)
    p = subprocess.Popen(
        [sys.executable, "-m", "llamapy", "run", str(tiny), "-p", PROMPT, "-n", "100000", "--ignore-eos", "--temp", "0",
         "-c", "2048", "--ray", address, "-ngl", "all", "-ts", "1,1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.read(64)  # generating
        node = sorted(ray_cluster.worker_nodes, key=lambda n: n.unique_id)[0]
        ray_cluster.remove_node(node, allow_graceful=False)  # the node dies mid-generation
        t0 = time.monotonic()
        _, err = p.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    text = err.decode(errors="replace").strip()
    last = text.splitlines()[-1] if text else ""
    assert p.returncode not in (0, None) and "Traceback" not in text, text[-3000:]
    assert last.startswith("error: ") and re.search(r"\bRAY[01]: device lost", last), text[-3000:]
    assert took < 30 + 15, took  # within the timeout (and the exit)
    # a later load starts afresh on what is left: one node, RAY0
    again = _run(tiny, "--ray", address, "-ngl", "all")
    assert again.returncode == 0 and "RAY0 model buffer" in again.stderr and "RAY1" not in again.stderr, again.stderr
    assert again.stdout == _run(tiny, "-ngl", "0").stdout


BATCH_PROMPTS = [("the cat", 4), ("Once upon a time", 100000), ("in the", 4), ("she said", 100000)]


def test_killed_node_during_batch_loses_no_finished_record(ray_cluster, address: str, tiny: Path,  # noqa: ANN001
                                                           tmp_path: Path) -> None:  # fmt: skip
    import json

    import cluster

    # two nodes again: the one the test above left, and a new one
    ray_cluster.add_node(num_cpus=1, resources={"llamapy": 1}, object_store_memory=cluster.STORE)
    ray_cluster.wait_for_nodes()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "n_predict": n}) + "\n" for p, n in BATCH_PROMPTS))
    flags = ["batch", str(tiny), str(prompts), "-np", "2", "-c", "4096", "--temp", "0", "--ignore-eos", "--no-progress"]
    short = tmp_path / "short.jsonl"  # the same prompts, all as short as 0 and 2: what they give on the CPU
    short.write_text("".join(json.dumps({"prompt": p, "n_predict": 4}) + "\n" for p, _ in BATCH_PROMPTS))
    base = tmp_path / "cpu.jsonl"
    r = cli("batch", str(tiny), str(short), "-o", str(base), "-np", "2", "--temp", "0", "--no-progress", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "ray.jsonl"
    env = dict(os.environ, LLAMAPY_RAY_TIMEOUT="30")
    env.pop("LLAMAPY_DEBUG", None)
    p = subprocess.Popen([sys.executable, "-m", "llamapy", *flags, "-o", str(out), "--ray", address, "-ngl", "all",
                          "-ts", "1,1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)  # fmt: skip
    try:
        t_end = time.monotonic() + 300
        while time.monotonic() < t_end and p.poll() is None:  # record 0 is out
            if out.exists() and out.read_text().strip():
                break
            time.sleep(0.2)
        time.sleep(3)  # prompt 2 (4 tokens) finishes too: its record waits in memory for 1's
        assert p.poll() is None, p.communicate()[1][-3000:]
        node = sorted(ray_cluster.worker_nodes, key=lambda n: n.unique_id)[0]
        ray_cluster.remove_node(node, allow_graceful=False)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    text = err.decode(errors="replace").strip()
    last = text.splitlines()[-1] if text else ""
    assert p.returncode == 1 and "Traceback" not in text, text[-3000:]
    m = re.match(rf"error: batch: RAY[01]: device lost \(compute\): .* \(prompts? ([0-9, ]+) running\); (\d) records written "
                 rf"to {re.escape(str(out))}; rerun with -o", last)  # fmt: skip
    assert m, text[-3000:]
    running = {int(i) for i in m.group(1).split(", ")}
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    written = {d["index"] for d in recs}
    want = {d["index"]: d["text"] for d in map(json.loads, base.read_text().splitlines())}
    # every finished record is there (2 normally: it had waited in memory), none of a running prompt
    assert 0 in written and 1 in running and not written & running and int(m.group(2)) == len(recs), (last, written)
    assert written <= {0, 2}
    assert all(d["finish_reason"] == "length" and d["text"] == want[d["index"]] for d in recs), (recs, want)
