"""Constrained generation on the default model: JSON schemas through the engine (per sequence,
in one batch), `llamapy run -j/-jf/--grammar`, `llamapy batch` files with per-line schemas,
Llama.create_*(response_format=, grammar=); every output validated with `jsonschema`. The twenty
schemas the server's test sends (tests/structured_cases.py) go through one `batch` file and,
in the slow suite, `llamapy run -j` each. The
unconstrained path never touches the constraint code; a dead end ends with its finish reason."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

import llamapy
from llamapy import engine as engine_mod
from llamapy.batch import BatchRequest, run_batch
from llamapy.model import constrain
from llamapy.model.constrain import ConstraintError, ConstraintSpec
from llamapy.model.sampler import SamplingParams

from structured_cases import SCHEMAS
from tests_support import cli

# (prompt, schema): nested objects, bounded arrays, enums, required/optional, number ranges,
# string patterns; bounded so that SmolLM2 at temp 0 finishes them within N_PREDICT
CASES = [
    ("A user record as JSON:", {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 16}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}}, "required": ["user"], "additionalProperties": False}),
    ("Three colors as JSON:", {"type": "object", "properties": {"colors": {"type": "array", "items": {
        "enum": ["red", "green", "blue", "yellow"]}, "minItems": 2, "maxItems": 4}}, "required": ["colors"],
        "additionalProperties": False}),
    ("A product as JSON:", {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "qty": {"type": "integer", "minimum": 1, "maximum": 99}, "note": {"type": "string", "maxLength": 20}},
        "required": ["sku", "price", "qty"], "additionalProperties": False}),
    ("A yes/no answer as JSON. Is the sky blue?", {"type": "object", "properties": {"answer": {"type": "boolean"},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"],
        "additionalProperties": False}),
    ("A list of points as JSON:", {"type": "array", "items": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -10, "maximum": 10}, "y": {"type": "integer", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"], "additionalProperties": False}, "minItems": 1, "maxItems": 3}),
    ("The weather as JSON:", {"type": "object", "properties": {"temp_c": {"type": "number", "exclusiveMinimum": -50, "maximum": 60},
        "sky": {"enum": ["clear", "cloudy", "rain"]}, "wind": {"type": "object", "properties": {
            "speed": {"type": "integer", "minimum": 0, "maximum": 200}, "dir": {"type": "string", "enum": ["N", "E", "S", "W"]}},
            "required": ["speed"], "additionalProperties": False}}, "required": ["temp_c", "sky"], "additionalProperties": False}),
]  # fmt: skip
N_PREDICT = 120
GREEDY = SamplingParams(temp=0)


def _spec(schema: dict) -> ConstraintSpec:
    return ConstraintSpec("json_schema", json.dumps(schema))


@pytest.fixture(scope="module")
def llm(default_model: Path):
    m = llamapy.Llama(default_model, n_ctx=2048, n_threads=1)
    yield m
    m.close()


def test_every_schema_in_one_batch_validates(llm: llamapy.Llama) -> None:
    """Six requests decoded together, each constrained by its own schema: every text validates
    against its own schema, and the first is the text it gives alone (matchers are per sequence)."""
    reqs = [BatchRequest(p, id=i, constraint=_spec(s)) for i, (p, s) in enumerate(CASES)]
    recs = {r.index: r for r in run_batch(llm.ctx, reqs, n_parallel=len(CASES), n_predict=N_PREDICT, sampling=GREEDY)}
    assert sorted(recs) == list(range(len(CASES)))
    for i, (_, schema) in enumerate(CASES):
        assert recs[i].error is None and recs[i].finish_reason == "stop", recs[i]
        jsonschema.validate(json.loads(recs[i].text), schema)
    alone = llm.generate(CASES[0][0], N_PREDICT, constraint=_spec(CASES[0][1]), temp=0)
    assert alone.text == recs[0].text and alone.finish_reason == "stop"


def test_unconstrained_generation_never_touches_the_constraint_code(llm: llamapy.Llama, monkeypatch) -> None:  # noqa: ANN001
    ref = llm.generate("The capital of France is", 12, temp=0)

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("constraint code ran for an unconstrained request")

    monkeypatch.setattr(engine_mod, "compile_constraint", boom)
    monkeypatch.setattr(constrain.Matcher, "mask", boom)
    monkeypatch.setattr(constrain.Matcher, "accept", boom)
    assert llm.generate("The capital of France is", 12, temp=0).text == ref.text


def test_a_dead_end_ends_the_request_with_its_finish_reason(llm: llamapy.Llama, monkeypatch) -> None:  # noqa: ANN001
    """A matcher that can allow no token (llguidance's error state, here forced) ends the request
    with finish reason "grammar_dead_end" and says why."""
    spec = ConstraintSpec("gbnf", 'root ::= "yes"')
    real = constrain.CompiledConstraint.matcher

    def broken(self: constrain.CompiledConstraint) -> constrain.Matcher:
        m = real(self)
        m._m.consume_token(llm.tokenize("no", add_special=False)[0])  # noqa: SLF001
        return m

    monkeypatch.setattr(constrain.CompiledConstraint, "matcher", broken)
    res = llm.generate("Answer:", 8, constraint=spec, temp=0)
    assert res.finish_reason == "grammar_dead_end" and res.tokens == []
    assert res.error.startswith("the grammar reached a dead end")


def test_api_response_format_and_grammar(llm: llamapy.Llama) -> None:
    schema = CASES[2][1]
    rf = {"type": "json_schema", "json_schema": {"name": "product", "schema": schema, "strict": True}}
    r = llm.create_chat_completion([{"role": "user", "content": "Give me a product."}], max_tokens=N_PREDICT,
                                   temperature=0, response_format=rf)  # fmt: skip
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    chunks = list(llm.create_chat_completion([{"role": "user", "content": "Give me a product."}], max_tokens=N_PREDICT,
                                             temperature=0, response_format=rf, stream=True))  # fmt: skip
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == choice["message"]["content"]
    # one example first: without it the greedy text ran past N_PREDICT on some hosts' kernels (an
    # AVX2-only Zen 2: an object of ever longer keys), a valid JSON prefix cut by the length limit
    shot = 'A cat as a JSON object with its name and age: {"name": "Tom", "age": 3}\n'
    r = llm.create_completion(shot + "A dog as a JSON object with its name and age:", max_tokens=N_PREDICT,
                              temperature=0, response_format={"type": "json_object"})  # fmt: skip
    assert r["choices"][0]["finish_reason"] == "stop" and isinstance(json.loads(r["choices"][0]["text"]), dict)
    r = llm.create_completion("Is the sky blue? Answer:", max_tokens=8, temperature=0, grammar='root ::= " yes" | " no"')
    assert r["choices"][0]["text"] in (" yes", " no") and r["choices"][0]["finish_reason"] == "stop"
    with pytest.raises(ConstraintError, match="uniqueItems"):
        llm.create_completion("x", response_format={"type": "json_schema", "json_schema": {"schema": {"uniqueItems": True}}})
    with pytest.raises(ConstraintError, match="not both"):
        llm.create_completion("x", grammar='root ::= "a"', response_format={"type": "json_object"})
    with pytest.raises(ConstraintError, match="invalid GBNF"):
        llm.create_completion("x", grammar="root ::= [a-", stream=True)  # raised at the call, not the first chunk
    with pytest.raises(ConstraintError, match="invalid regex"):
        llm.stream("x", 4, constraint=ConstraintSpec("regex", "a(b"))


def test_cli_run_json_schema_and_grammar(default_model: Path, tmp_path: Path) -> None:
    prompt, schema = CASES[1]
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(schema))
    r = cli("run", str(default_model), "-p", prompt, "-n", str(N_PREDICT), "--temp", "0", "-jf", str(f), "--log-disable")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), schema)
    r2 = cli("run", str(default_model), "-p", prompt, "-n", str(N_PREDICT), "--temp", "0", "-j", json.dumps(schema), "--log-disable")
    assert r2.returncode == 0 and r2.stdout == r.stdout
    g = tmp_path / "yn.gbnf"
    g.write_text('root ::= " yes" | " no"\n')
    r = cli("run", str(default_model), "-p", "Is the sky blue? Answer:", "-n", "8", "--temp", "0", "--grammar-file", str(g))
    assert r.returncode == 0 and r.stdout.strip() in ("yes", "no") and "[end of text]" in r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--grammar", "root ::= [a-"], "error: invalid GBNF grammar: Unexpected end of input at line 1"),
        (["-j", '{"type": "object",'], "error: the JSON schema is not valid JSON: Expecting property name"),
        (["-j", '{"not": {}}'], 'error: invalid json schema: Unimplemented keys: ["not"]'),
        (["-j", "{}", "--grammar", 'root ::= "a"'], "error: give one of --grammar, --grammar-file, -j, -jf (got --grammar and -j)"),
        (["-jf", "/nonexistent/schema.json"], "error: -jf /nonexistent/schema.json: no such file"),
        (["--grammar-file", "/nonexistent/g.gbnf"], "error: --grammar-file /nonexistent/g.gbnf: no such file"),
    ],
)
def test_cli_constraint_errors_are_one_line(default_model: Path, args: list[str], message: str) -> None:
    r = cli("run", str(default_model), "-p", "x", "-n", "4", *args)
    assert r.returncode == 1 and r.stdout == ""
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message) and r.stderr.strip().endswith(errors[0])
    assert "Traceback" not in r.stderr


def test_cli_batch_file_with_per_line_schemas(default_model: Path, tmp_path: Path) -> None:
    src = tmp_path / "p.jsonl"
    lines = [{"prompt": p, "json_schema": s} for p, s in CASES[:3]]
    lines.append({"prompt": "Is water wet? Answer:", "grammar": 'root ::= " yes" | " no"'})
    lines.append({"prompt": "Points:", "json_schema": json.dumps(CASES[4][1])})  # the schema as JSON text
    lines.append({"prompt": "Anything:"})  # takes the batch-wide -j
    lines.append({"prompt": "bad", "json_schema": {"type": "array", "uniqueItems": True}})
    lines.append({"prompt": "both", "json_schema": {}, "grammar": 'root ::= "a"'})
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    r = cli("batch", str(default_model), str(src), "-o", str(out), "-n", str(N_PREDICT), "--temp", "0",
            "-np", "4", "--no-progress", "-j", json.dumps(CASES[3][1]))  # fmt: skip
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["index"] for x in recs] == list(range(len(lines)))
    for i, schema in ((0, CASES[0][1]), (1, CASES[1][1]), (2, CASES[2][1]), (4, CASES[4][1]), (5, CASES[3][1])):
        assert recs[i]["finish_reason"] == "stop", recs[i]
        jsonschema.validate(json.loads(recs[i]["text"]), schema)
    assert recs[3]["text"] in (" yes", " no")
    assert 'Unimplemented keys: ["uniqueItems"]' in recs[6]["error"]
    assert recs[7]["error"] == "line 8: give `json_schema` or `grammar`, not both"


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)))
def test_cli_run_every_schema(default_model: Path, case: int) -> None:
    prompt, schema = CASES[case]
    r = cli("run", str(default_model), "-p", prompt, "-n", str(N_PREDICT), "--temp", "0", "-j", json.dumps(schema), "--log-disable")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), schema)


def test_cli_batch_file_with_the_servers_twenty_schemas(default_model: Path, tmp_path: Path) -> None:
    """One `batch` file, a `json_schema` per line (the server test's twenty schemas): every record
    completes its grammar ("stop") and validates against its own line's schema."""
    src = tmp_path / "schemas.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "json_schema": s, "id": i}) + "\n" for i, (p, s) in enumerate(SCHEMAS)))
    out = tmp_path / "out.jsonl"
    r = cli("batch", str(default_model), str(src), "-o", str(out), "-n", str(N_PREDICT), "--temp", "0",
            "-np", "4", "-c", "2048", "--no-progress")  # fmt: skip
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in recs] == list(range(len(SCHEMAS)))
    for rec, (_, schema) in zip(recs, SCHEMAS):
        assert rec.get("error") is None and rec["finish_reason"] == "stop", rec
        jsonschema.validate(json.loads(rec["text"]), schema)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_cli_run_j_with_the_servers_schemas(default_model: Path, i: int) -> None:
    """`llamapy run -j` (a process each, ~2-4 s on 2 busy cores): the output is JSON valid
    against the schema, and the grammar completed (`[end of text]`, exit 0)."""
    prompt, schema = SCHEMAS[i]
    r = cli("run", str(default_model), "-p", prompt, "-n", str(N_PREDICT), "--temp", "0", "-j", json.dumps(schema))
    assert r.returncode == 0, r.stderr
    assert "[end of text]" in r.stderr, r.stderr[-400:]
    jsonschema.validate(json.loads(r.stdout), schema)


def test_cli_conversation_constrains_each_answer(default_model: Path) -> None:
    """Conversation mode (-cnv, turns on stdin) holds every answer to the grammar, and a
    single-turn chat (-st) to the JSON schema."""
    r = cli("run", str(default_model), "-cnv", "--temp", "0", "-n", "16", "--grammar", 'root ::= ("yes" | "no") "."',
            stdin="Is the sky blue?\nIs fire cold?\nIs water wet?\n")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 3 and set(r.stdout.splitlines()) <= {"yes.", "no."}, r.stdout
    prompt, schema = SCHEMAS[0]
    r = cli("run", str(default_model), "-cnv", "-st", "-p", prompt, "--temp", "0", "-n", str(N_PREDICT), "-j", json.dumps(schema),
            stdin="")  # fmt: skip
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), schema)
