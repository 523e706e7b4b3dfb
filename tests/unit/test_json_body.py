"""The nesting-depth check of request bodies: the limit itself is allowed, one more level is not,
whether the nesting is in lists or objects, and wide bodies cost no recursion."""

from __future__ import annotations

import json

from lorad.daemon.json_body import MAX_DEPTH, _depth_exceeds


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
