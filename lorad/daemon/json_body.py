"""A request body read as strict JSON, with limits that make a hostile body a 4xx, never a 5xx.

Refused with a 400 (code invalid_json): bytes that are not UTF-8, NaN/Infinity literals (Python's
json accepts them; JSON does not), nesting deeper than MAX_DEPTH, integers longer than Python
reads; a compressed body that does not decompress is a 400 invalid_body. Over MAX_BODY_BYTES
(after decompression): a 413. Field-level checks (types, ranges) are schemas.py's.
"""

from __future__ import annotations

import json

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from lorad.daemon.errors import ApiError, bad_request

MAX_BODY_BYTES = 32 * 1024 * 1024  # a long prompt as a JSON list of ids is several MB
MAX_DEPTH = 32  # an OpenAI body needs 5 (messages[i].content[j].text)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


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
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:  # nested past Python's own limit, far beyond ours
        raise _too_deep() from None
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    if _depth_exceeds(body, MAX_DEPTH):
        raise _too_deep()
    return body


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
