"""A request's output constraint: OpenAI's response_format (json_object, json_schema) or lorad's
`regex` and `grammar` fields, checked and compiled to llguidance's grammar text on arrival.

A bad schema, regex or grammar is a 400 naming the field before anything is admitted. Compiled
grammars (and refusals) are cached by content, LRU-bounded. The leader builds the matcher from
the text (lorad/workers/grammar.py); this module never sees a tokenizer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

from lorad.daemon.errors import bad_request

MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema, regex or grammar as sent; real ones are far smaller
NUM_CACHED_GRAMMARS = 256
# Whitespace between JSON tokens, bounded: llguidance's default ([ \n\r\t]+) let the demo model
# pad an answer with newlines until max_tokens. A schema's "x-guidance" may override it.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A]{0,20}"}
CONSTRAINT_FIELDS = ("response_format", "regex", "grammar")


@dataclass(frozen=True)
class Constraint:
    where: str  # the request field it came from, for error messages
    grammar: str  # llguidance's grammar text (its JSON form or Lark), as the Admit carries it


def parse_constraint(body: dict) -> Constraint | None:
    """-> the request's one constraint, compiled, or None; a 400 naming the field otherwise."""
    given = [name for name in CONSTRAINT_FIELDS
             if body.get(name) is not None and body.get(name) != {"type": "text"}]
    if len(given) > 1:
        raise bad_request(f"{' and '.join(given)} are both set; send one output constraint",
                          given[1])
    if not given:
        return None
    if body.get("ignore_eos"):
        raise bad_request("ignore_eos cannot be combined with an output constraint: the "
                          "constraint ends the completion with an end-of-sequence token",
                          "ignore_eos")
    if body.get("min_tokens"):  # a complete answer leaves only the masked stop tokens
        raise bad_request("min_tokens cannot be combined with an output constraint: the "
                          "constraint decides where the completion ends", "min_tokens")
    if given[0] == "response_format":
        where, kind, source = _response_format(body["response_format"])
    else:
        where, kind, source = given[0], given[0], _string(body[given[0]], given[0])
    grammar, error = _compile(kind, source)
    if error:
        raise bad_request(f"{where}: {error}", where, "invalid_constraint")
    return Constraint(where, grammar)


def compile_json_schema(schema: dict, where: str) -> Constraint:
    """A JSON schema from another field (a tool's parameters), compiled as response_format's is;
    a 400 naming `where` if llguidance refuses it."""
    grammar, error = _compile("json_schema",
                              _string(json.dumps(schema, ensure_ascii=False), where))
    if error:
        raise bad_request(f"{where}: {error}", where, "invalid_constraint")
    return Constraint(where, grammar)


def _response_format(fmt: object) -> tuple[str, str, str]:
    """-> (field, kind, source text) of a response_format other than text."""
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object", "response_format", "invalid_type")
    kind = fmt.get("type")
    if kind == "json_object":
        return "response_format", "json_schema", '{"type": "object"}'
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, got "
                          f"{kind!r}", "response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object",
                          "response_format.json_schema", "invalid_type")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("response_format.json_schema.name must be a string",
                          "response_format.json_schema.name", "invalid_type")
    if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
        raise bad_request("response_format.json_schema.strict must be a boolean",
                          "response_format.json_schema.strict", "invalid_type")
    where = "response_format.json_schema.schema"
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON Schema object", where, "invalid_type")
    # Key order is kept: llguidance emits properties in the order the schema lists them.
    return where, "json_schema", _string(json.dumps(schema, ensure_ascii=False), where)


def _string(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where} must be a non-empty string", where, "invalid_type")
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise bad_request(f"{where} is {len(value)} characters long; at most "
                          f"{MAX_CONSTRAINT_CHARS} are accepted", where)
    return value


@lru_cache(maxsize=NUM_CACHED_GRAMMARS)
def _compile(kind: str, source: str) -> tuple[str, str]:
    """-> (llguidance grammar, "") or ("", the engine's error). Cached by content: a client that
    repeats its schema pays for the check once."""
    # Imported here: an environment without it (the GPU image's PYTHONPATH) still serves the rest.
    from llguidance import LLMatcher

    try:
        if kind == "json_schema":
            grammar = LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(source)
        else:
            grammar = LLMatcher.grammar_from_lark(source)
    except ValueError as exc:  # a schema llguidance cannot read as JSON
        return "", str(exc)
    error = LLMatcher.validate_grammar(grammar)
    return ("", _without_listing(error)) if error else (grammar, "")


def _without_listing(error: str) -> str:
    """llguidance's error on one line, less the source listing and caret it draws under it."""
    lines = [line.strip() for line in error.strip().splitlines()]
    kept = [line for line in lines if line and not _LISTING.match(line)]
    return "; ".join(kept)


_LISTING = re.compile(r"^(\d+ \|.*|[\^~ ]+)$")


def cache_info():
    return _compile.cache_info()
