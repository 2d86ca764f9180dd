"""The twenty (prompt, JSON schema) cases of issue 30's "Done when", in one place: the server's
response_format test (tests/server/test_structured.py), `llamapy run -j` and a `batch` file
(tests/model/test_constrained.py) all take these, and validate every output with `jsonschema`.
Nested objects, arrays with bounds, enums, required/optional, numbers with ranges, strings with
patterns; each allows a short answer (strings and arrays bounded), so SmolLM2 at temp 0 completes
it well within the tests' token limits."""

from __future__ import annotations

OBJ = {"type": "object", "additionalProperties": False}


def obj(props: dict, required: list[str] | None = None, **kw: object) -> dict:
    return dict(OBJ, properties=props, required=list(props) if required is None else required, **kw)


STR = {"type": "string", "maxLength": 12}
SCHEMAS = [
    ("Describe a person: name and age.", obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("Give a person's first and last name.", obj({"person": obj({"first": STR, "last": STR})})),
    ("List two or three colors.", obj({"colors": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 3}})),
    ("Is the sky green?", obj({"answer": {"enum": ["yes", "no", "maybe"]}})),
    ("What is the temperature today in Celsius?", obj({"temperature": {"type": "integer", "minimum": -50, "maximum": 50}})),
    ("Give a US zip code.", obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("Name a city, and its country if you know it.", obj({"city": STR, "country": STR}, required=["city"])),
    ("A shopping list of one or two items with quantities.", obj({"items": {"type": "array", "minItems": 1, "maxItems": 2,
                                                                  "items": obj({"name": STR, "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}})),
    ("Is Paris the capital of France?", obj({"is_capital": {"type": "boolean"}})),
    ("Three numbers between 1 and 100.", {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 100}, "minItems": 3, "maxItems": 3}),
    ("A ticket's priority and status.", obj({"priority": {"type": "integer", "enum": [1, 2, 3]}, "status": {"type": "string", "enum": ["open", "closed"]}})),
    ("What is today's date?", obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}})),
    ("Rate this on a scale of 0 to 10.", obj({"rating": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}})),
    ("A nested value.", obj({"a": obj({"b": obj({"c": {"type": "integer", "minimum": 0, "maximum": 9}})})})),
    ("Report the version and whether it is ok.", obj({"version": {"const": "1.0"}, "ok": {"type": "boolean"}})),
    ("A small number or a short word.", obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "string", "maxLength": 5}]}})),
    ("An airport code.", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}})),
    ("A line segment from one point to another.", {"$defs": {"point": obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                                            "y": {"type": "integer", "minimum": -9, "maximum": 9}})},
                                                   **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})}),
    ("Your middle name, if any.", obj({"middle_name": {"type": ["string", "null"], "maxLength": 10}})),
    ("Tag this with colors and a score from 0 to 10.", obj({"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
                                                            "score": {"type": "integer", "minimum": 0, "maximum": 10}})),
]  # fmt: skip
