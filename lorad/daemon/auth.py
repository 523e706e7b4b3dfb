"""Bearer-key authentication of the HTTP API (`--api-key` / `--api-key-file`).

Every route but the probes (/health, /ready) needs `Authorization: Bearer KEY`; the key is
compared in constant time. Unknown paths are refused the same way, so an unauthenticated client
learns nothing about which routes exist.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from lorad.daemon.errors import error_response

OPEN_PATHS = frozenset({"/health", "/ready"})


def auth_middleware(api_key: str):
    expected = api_key.encode()

    @web.middleware
    async def require_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        # compare_digest takes as long whatever the first differing byte; a missing header goes
        # through the same comparison.
        valid = hmac.compare_digest(presented.strip().encode(), expected)
        if scheme.lower() != "bearer" or not valid:
            return error_response(401, "a valid API key is needed: 'Authorization: Bearer KEY'",
                                  code="invalid_api_key",
                                  headers={"WWW-Authenticate": 'Bearer realm="lorad"'})
        return await handler(request)

    return require_key
