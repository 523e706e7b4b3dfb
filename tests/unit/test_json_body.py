"""The nesting-depth check of request bodies: the limit itself is allowed, one more level is not,
whether the nesting is in lists or objects, and wide bodies cost no recursion. Duplicated keys:
found at any depth, in arrays of objects, named with their path, and none where there is none."""

from __future__ import annotations

import json

import pytest

from lorad.daemon.errors import ApiError
from lorad.daemon.json_body import MAX_DEPTH, _depth_exceeds, _duplicated, _find_duplicated, _parse


def _nested(depth: int, kind: str) -> object:
    text = ("[" * depth + "]" * depth) if kind == "list" else \
        ('{"a":' * (depth - 1) + "{}" + "}" * (depth - 1))
    return json.loads(text)


def test_the_limit_is_allowed_and_one_more_level_is_not():
    for kind in ("list", "object"):
        assert not _depth_exceeds(_nested(MAX_DEPTH, kind), MAX_DEPTH), kind
        assert _depth_exceeds(_nested(MAX_DEPTH + 1, kind), MAX_DEPTH), kind


def test_scalars_and_wide_bodies_pass():
    assert not _depth_exceeds("text", 1) and not _depth_exceeds(None, 1)
    body = {"model": "m", "prompt": list(range(100_000)),
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}] * 1000}
    assert not _depth_exceeds(body, 5) and _depth_exceeds(body, 4)


def _refusal(text: str) -> ApiError | None:
    body, has_duplicated = _parse(text)
    return _duplicated(*_find_duplicated(body)) if has_duplicated else None


@pytest.mark.parametrize("text, param, where", [
    ('{"model": "a", "prompt": "x", "model": "b"}', "model", "the request body"),
    ('{"model": "a", "stream_options": {"include_usage": true, "include_usage": false}}',
     "stream_options.include_usage", "stream_options"),
    ('{"messages": [{"role": "user", "content": "a"},'
     ' {"role": "system", "content": "b", "role": "user"}]}', "messages[1].role", "messages[1]"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "text": "b"}]}]}',
     "messages[0].content[0].text", "messages[0].content[0]"),
    ('[[{"k": 1}], [{"k": 1, "k": 1}]]', "[1][0].k", "[1][0]"),
    ('{"response_format": {"json_schema": {"schema": {"properties": {"a": {}, "a": {}}}}}}',
     "response_format.json_schema.schema.properties.a",
     "response_format.json_schema.schema.properties"),
])
def test_duplicated_keys_are_named_with_their_path(text, param, where):
    error = _refusal(text)
    key = param.rsplit(".", 1)[-1] if "." in param else param.rsplit("]", 1)[-1].lstrip(".")
    assert error is not None and error.status == 400 and error.code == "duplicated_key"
    assert error.param == param
    assert error.message == f'duplicated key "{key}" in {where}'


def test_the_first_duplicate_in_document_order_is_named():
    error = _refusal('{"a": {"x": 1, "x": 2}, "b": {"y": 1, "y": 2}, "a": 3}')
    assert error.param == "a"  # the outer object comes first
    error = _refusal('{"a": [{"x": 1}, {"x": 1, "x": 2}], "b": {"y": 1, "y": 2}}')
    assert error.param == "a[1].x"


def test_no_false_positive():
    # The same key in sibling objects, in nested objects, as a value, and keys that differ only
    # in case or by an escape are all distinct keys.
    for text in ('{"messages": [{"role": "user", "content": "a"},'
                 ' {"role": "user", "content": "b"}]}',
                 '{"a": {"a": {"a": "a"}}, "b": ["a", "a"]}',
                 '{"Model": 1, "model": 2, "mod\\u0065l2": 3}',
                 '[]', '"text"', '{}'):
        assert _refusal(text) is None, text


def test_a_key_spelt_with_an_escape_is_the_same_key():
    error = _refusal('{"model": "a", "mod\\u0065l": "b"}')
    assert error is not None and error.param == "model"
