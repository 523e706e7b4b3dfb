"""Output constraints as the coordinator reads them: response_format (json_object, json_schema),
`regex` and `grammar` compile to llguidance grammar text; each bad input is a 400 whose param and
message name the field and the problem; one constraint per request; the compile cache."""

from __future__ import annotations

import json

import pytest

from lorad.daemon import constraints
from lorad.daemon.constraints import MAX_CONSTRAINT_CHARS, parse_constraint
from lorad.daemon.errors import ApiError
from lorad.daemon.schemas import parse_chat, parse_completion

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}}}


def schema_format(schema, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, **extra}}


def refused(body: dict, param: str, text: str) -> None:
    with pytest.raises(ApiError) as exc:
        parse_constraint(body)
    assert exc.value.status == 400
    assert exc.value.param == param, exc.value.message
    assert text in exc.value.message, exc.value.message


@pytest.mark.parametrize("body,kind", [
    ({"response_format": {"type": "json_object"}}, '"type":"object"'),
    ({"response_format": schema_format(PERSON, strict=True)}, '"additionalProperties":false'),
    ({"regex": "[0-9]{4}-[0-9]{2}"}, "[0-9]{4}-[0-9]{2}"),
    ({"grammar": 'start: "yes" | "no"'}, '"yes"'),
])
def test_constraints_compile_to_grammar_text(body, kind):
    constraint = parse_constraint(body)
    assert isinstance(constraint.grammar, str)  # it travels as text, never as an object
    assert kind in constraint.grammar.replace(" ", "") or kind in constraint.grammar


@pytest.mark.parametrize("body", [{}, {"response_format": {"type": "text"}},
                                  {"response_format": None, "regex": None}])
def test_no_constraint(body):
    assert parse_constraint(body) is None


@pytest.mark.parametrize("body,param,text", [
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "got 'xml'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "must be an object"),
    ({"response_format": schema_format([1])}, "response_format.json_schema.schema",
     "must be a JSON Schema object"),
    ({"response_format": schema_format({"type": "objec"})}, "response_format.json_schema.schema",
     "objec"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}},
     "response_format.json_schema.name", "must be a string"),
    ({"response_format": schema_format({}, strict="yes")}, "response_format.json_schema.strict",
     "must be a boolean"),
    ({"regex": "[a-"}, "regex", "unclosed character class"),
    ({"regex": 5}, "regex", "must be a non-empty string"),
    ({"regex": ""}, "regex", "must be a non-empty string"),
    ({"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}, "regex", "characters long"),
    ({"grammar": "start: foo"}, "grammar", 'unknown name: "foo"'),
    ({"grammar": "start: ("}, "grammar", "Expected token ')'"),
    ({"grammar": 'foo: "a"'}, "grammar", "no start rule found"),
    ({"regex": "a", "grammar": 'start: "a"'}, "grammar", "regex and grammar are both set"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex",
     "response_format and regex are both set"),
    ({"regex": "a", "ignore_eos": True}, "ignore_eos", "cannot be combined"),
])
def test_bad_constraints_are_400s_naming_the_field(body, param, text):
    refused(body, param, text)


def test_both_routes_carry_the_constraint():
    chat = parse_chat({**CHAT, "response_format": {"type": "json_object"}})
    completion = parse_completion({"model": "m", "prompt": "x", "regex": "[a-z]+"})
    assert chat.constraint.where == "response_format"
    assert completion.constraint.where == "regex"
    assert parse_chat(CHAT).constraint is None


def test_compiled_grammars_are_cached_by_content():
    before = constraints.cache_info()
    body = {"response_format": schema_format({"type": "object", "properties": {
        "cached": {"type": "boolean"}}})}
    first = parse_constraint(body)
    second = parse_constraint(json.loads(json.dumps(body)))  # an equal, separate object
    after = constraints.cache_info()
    assert first == second
    assert after.hits == before.hits + 1 and after.misses == before.misses + 1
    assert after.maxsize == constraints.NUM_CACHED_GRAMMARS


def test_refusals_are_cached_too():
    refused({"regex": "(unclosed"}, "regex", "regex")
    hits = constraints.cache_info().hits
    refused({"regex": "(unclosed"}, "regex", "regex")
    assert constraints.cache_info().hits == hits + 1
