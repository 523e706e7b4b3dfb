"""A request body read as strict JSON, with limits that make a hostile body a 4xx, never a 5xx.

Refused with a 400 (code invalid_json): bytes that are not UTF-8, NaN/Infinity literals (Python's
json accepts them; JSON does not), nesting deeper than MAX_DEPTH, integers longer than Python
reads; an object with the same key twice, at any depth, is a 400 duplicated_key naming the key and
its path (a gateway that reads the first `model` and lorad the last must not disagree); a
compressed body that does not decompress is a 400 invalid_body. Over MAX_BODY_BYTES (after
decompression): a 413. Field-level checks (types, ranges) are schemas.py's.
"""

from __future__ import annotations

import json

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from lorad.daemon.errors import ApiError, bad_request

MAX_BODY_BYTES = 32 * 1024 * 1024  # a long prompt as a JSON list of ids is several MB
MAX_DEPTH = 32  # an OpenAI body needs 5 (messages[i].content[j].text)


class _Duplicated(dict):
    """An object that held `key` twice: kept in the tree so the walk can name where it is."""

    def __init__(self, pairs: list, key: str) -> None:
        super().__init__(pairs)
        self.duplicated_key = key


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _parse(text: str) -> tuple[object, bool]:
    """The parsed body, and whether some object in it held a key twice."""
    found = False

    def build_object(pairs: list) -> dict:
        nonlocal found
        obj = dict(pairs)
        if len(obj) == len(pairs):
            return obj
        found = True
        seen = set()
        for key, _ in pairs:
            if key in seen:
                # Objects are built innermost first, with no path known: the walk names it.
                return _Duplicated(pairs, key)
            seen.add(key)
        raise AssertionError("fewer keys than pairs, yet no key seen twice")

    body = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=build_object)
    return body, found


async def read_json(request: web.Request) -> object:
    try:
        raw = await request.read()  # decompressed when sent with Content-Encoding
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", None,
                       "request_too_large") from None
    except RequestPayloadError as exc:  # e.g. Content-Encoding: gzip over bytes that are not
        raise bad_request(f"the body could not be read: {exc}", None, "invalid_body") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the body is not valid UTF-8: {exc}", None, "invalid_json") from None
    try:
        body, has_duplicated = _parse(text)
    except RecursionError:  # nested past Python's own limit, far beyond ours
        raise _too_deep() from None
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    if _depth_exceeds(body, MAX_DEPTH):
        raise _too_deep()
    if has_duplicated:
        raise _duplicated(*_find_duplicated(body))
    return body


def _duplicated(path: str, key: str) -> ApiError:
    where = path if path else "the request body"
    return bad_request(f"duplicated key {json.dumps(key, ensure_ascii=False)} in {where}",
                       f"{path}.{key}" if path else key, "duplicated_key")


def _too_deep() -> ApiError:
    return bad_request(f"the body is nested deeper than {MAX_DEPTH} levels", None, "invalid_json")


def _depth_exceeds(value: object, limit: int) -> bool:
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        container, depth = stack.pop()
        if depth > limit:
            return True
        children = container.values() if isinstance(container, dict) else container
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return False


def _find_duplicated(value: object) -> tuple[str, str]:
    """(path of the object, its duplicated key) for the first such object in document order."""
    stack = [(value, "")] if isinstance(value, (dict, list)) else []
    while stack:
        container, path = stack.pop()
        if isinstance(container, _Duplicated):
            return path, container.duplicated_key
        if isinstance(container, dict):
            children = [(child, f"{path}.{key}" if path else key)
                        for key, child in container.items() if isinstance(child, (dict, list))]
        else:
            children = [(child, f"{path}[{i}]") for i, child in enumerate(container)
                        if isinstance(child, (dict, list))]
        # Reversed so the first duplicate in document order is the one named.
        stack.extend(reversed(children))
    raise AssertionError("the parser reported a duplicated key the walk did not find")
