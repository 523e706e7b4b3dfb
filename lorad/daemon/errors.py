"""OpenAI-style error bodies and the middleware that turns every failure into one.

Bad input is an ApiError (4xx) raised before any stream opens; aiohttp's own 404/405/413 get the
same JSON shape; anything unexpected is logged and answered as a 500 without a traceback.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web

log = logging.getLogger("lorad.http")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable", 504: "timeout_error"}


class ApiError(Exception):
    """A request lorad refuses; `status` is the HTTP status, `param` the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 429 or 503

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> web.Response:
    return web.Response(status=status, text=json.dumps(error_body(status, message, param, code)),
                        content_type="application/json", headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        message = f"{exc.reason}: {request.method} {request.path}"
        return error_response(exc.status, message, None, exc.reason.lower().replace(" ", "_"),
                              headers=headers)
    except ConnectionResetError:
        raise  # the client went away; there is nobody to answer
    except Exception:
        log.exception("unexpected error handling %s %s", request.method, request.path)
        return error_response(500, "internal server error (logged by lorad)", code="internal_error")
