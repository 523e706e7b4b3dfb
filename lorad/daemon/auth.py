"""Bearer-key authentication of the HTTP API (`--api-key` / `--api-key-file`) and of the adapter
admin routes (`--admin-key-file`).

Every route but the probes (/health, /ready) needs `Authorization: Bearer KEY`; the key is
compared in constant time. Unknown paths are refused the same way, so an unauthenticated client
learns nothing about which routes exist. The admin routes take the admin key instead of the API
key (never both: one Authorization header).
"""

from __future__ import annotations

import hmac

from aiohttp import web

from lorad.daemon.errors import error_response

OPEN_PATHS = frozenset({"/health", "/ready"})


def auth_middleware(api_key: str, exempt: tuple[str, ...] = (),
                    only: tuple[str, ...] | None = None):
    """Require `api_key` on every path but the probes and those under `exempt`; with `only`,
    on the paths under those prefixes alone (the admin key)."""
    expected = api_key.encode()
    what = "API key" if only is None else "admin key (--admin-key-file)"

    @web.middleware
    async def require_key(request: web.Request, handler) -> web.StreamResponse:
        path = request.path
        if (path in OPEN_PATHS or path.startswith(exempt)
                or (only is not None and not path.startswith(only))):
            return await handler(request)
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        # compare_digest takes as long whatever the first differing byte; a missing header goes
        # through the same comparison.
        valid = hmac.compare_digest(presented.strip().encode(), expected)
        if scheme.lower() != "bearer" or not valid:
            return error_response(401, f"a valid {what} is needed: 'Authorization: Bearer KEY'",
                                  code="invalid_api_key",
                                  headers={"WWW-Authenticate": 'Bearer realm="lorad"'})
        return await handler(request)

    return require_key
