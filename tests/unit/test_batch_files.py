"""`llamapy batch`'s files: resuming onto an output written for other prompts is refused (naming
the first record that differs); a line of invalid UTF-8 is an error record while the others run;
`max_tokens` in a JSONL request is n_predict's other name. The installed CLI, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def batch(model: Path, src: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    args = ["batch", str(model), str(src), "-o", str(out), "-np", "2", "-c", "128", "--temp", "0", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "LLAMAPY_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "llamapy", *args, *extra], capture_output=True, text=True, env=env, timeout=300
    )


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import write_llama_gguf

    return write_llama_gguf(tmp_path_factory.mktemp("m") / "m.gguf", n_layer=1)


def test_resume_onto_other_prompts_is_refused(model: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("the a\nof to\nin he\n")
    r = batch(model, src, out, "-n", "1")
    assert r.returncode == 0, r.stderr
    first = out.read_bytes()
    assert [x["index"] for x in records(out)] == [0, 1, 2]
    src.write_text("the a\nSOMETHING ELSE\nin he\n")  # line 2 edited
    r = batch(model, src, out, "-n", "1")
    assert r.returncode == 1
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "record 1" in err[0] and "SOMETHING ELSE" in err[0], r.stderr
    assert "Traceback" not in r.stderr
    assert out.read_bytes() == first  # untouched
    src.write_text("the a\nof to\n")  # fewer prompts than records: another input too
    r = batch(model, src, out, "-n", "1")
    assert r.returncode == 1 and "record 2" in r.stderr
    # the same prompts with more lines after them: a resume that runs only the new ones
    src.write_text("the a\nof to\nin he\nshe it\n")
    r = batch(model, src, out, "-n", "1")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes().startswith(first)
    assert [x["index"] for x in records(out)] == [0, 1, 2, 3]


def test_a_line_of_invalid_utf8_is_an_error_record(model: Path, tmp_path: Path) -> None:
    for name, bad in (("in.txt", b"of \xff\xfe to"), ("in.jsonl", b'{"prompt": "of \xff to"}')):
        src, out = tmp_path / name, tmp_path / f"{name}.out.jsonl"
        good = [b'{"prompt": "the a"}', b'{"prompt": "in he"}'] if name.endswith("jsonl") else [b"the a", b"in he"]
        src.write_bytes(good[0] + b"\n" + bad + b"\n" + good[1] + b"\n")
        r = batch(model, src, out, "-n", "2")
        assert r.returncode == 0, r.stderr
        recs = records(out)
        assert [x["index"] for x in recs] == [0, 1, 2]
        assert "not valid UTF-8" in recs[1]["error"] and "line 2" in recs[1]["error"]
        assert "error" not in recs[0] and "error" not in recs[2]
        assert recs[0]["prompt"] == "the a" and recs[2]["prompt"] == "in he"
        r = batch(model, src, out, "-n", "2")  # and such a file resumes (nothing left to do)
        assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr


def test_max_tokens_is_honoured(model: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"prompt": "the a", "id": "free"},
        {"prompt": "the a", "id": "max2", "max_tokens": 2},
        {"prompt": "the a", "id": "both", "max_tokens": 1, "n_predict": 1},
        {"prompt": "the a", "id": "clash", "max_tokens": 1, "n_predict": 3},
        {"prompt": "the a", "id": "bad", "max_tokens": "3"},
    ]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = batch(model, src, out, "-n", "6")
    assert r.returncode == 0, r.stderr
    free, max2, both, clash, bad = records(out)
    assert free["n_tokens"] > 2, free  # greedy on this model: no early end of generation
    assert max2["n_tokens"] == 2 and max2["finish_reason"] == "length"
    assert max2["text"] and free["text"].startswith(max2["text"])
    assert both["n_tokens"] == 1
    assert "disagree" in clash["error"]
    assert "max_tokens" in bad["error"]


def test_check_resume_names_the_first_differing_record(tmp_path: Path) -> None:
    from llamapy.cli.batch import check_resume, read_inputs
    from llamapy.types import LlamapyError

    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a", "id": "x"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    items = read_inputs(str(src))
    ok = {0: {"index": 0, "id": "x", "prompt": "a"}, 1: {"index": 1, "id": 1, "prompt": "b"}}
    check_resume(items, ok, "out.jsonl", "in.jsonl")  # a prefix of this input's records: fine
    bad_cases = [
        ({**ok, 2: {"index": 2, "id": 2, "prompt": "C"}}, "record 2", "'C'"),
        ({0: {"index": 0, "id": "y", "prompt": "a"}}, "record 0", "id 'y'"),
        ({1: {"index": 1, "id": 1, "error": "line 2: invalid JSON"}}, "record 1", "no prompt"),
        ({5: {"index": 5, "id": 5, "prompt": "f"}}, "record 5", "only 3 prompts"),
    ]
    for records, *needles in bad_cases:
        with pytest.raises(LlamapyError) as e:
            check_resume(items, records, "out.jsonl", "in.jsonl")
        assert all(n in str(e.value) for n in needles), str(e.value)
