"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import logging

from aiohttp import web
from aiohttp.typedefs import Handler

log = logging.getLogger("ferry.errors")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict[str, object]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(error_body(status, message, code=code, param=param)),
        content_type="application/json",
        headers=headers,
    )


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn aiohttp's own HTTP errors (404 route, 405, 413), a body it cannot
    read (a Content-Encoding that does not decode) and Ferry's own faults into
    the OpenAI shape."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason, headers=_keep_headers(exc))
    except web.RequestPayloadError as exc:
        why = getattr(exc.__cause__, "message", None) or str(exc)
        response = error_response(400, f"request body could not be read: {why}")
        # The rest of the body cannot be read either: the connection ends with
        # this answer, and aiohttp is told the body is over (else it reads on
        # after the answer, meets the same error and logs it as unhandled).
        response.force_close()
        request.content.feed_eof()
        return response
    except ConnectionResetError:
        raise  # the client is gone: nothing to answer
    except Exception as exc:
        # A fault of Ferry's own. Once its answer has begun, aiohttp logs it and
        # cuts the connection; before, it is logged here and the client gets the
        # OpenAI shape (aiohttp would answer text/plain).
        if request.writer.output_size:
            raise
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"internal error: {type(exc).__name__}", code="internal_error")


def _keep_headers(exc: web.HTTPException) -> dict[str, str]:
    return {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
