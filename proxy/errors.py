"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}};
on Anthropic's Messages route, in Anthropic's: {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

import json
import logging
import re

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.typedefs import Handler, LooseHeaders
from aiohttp.web_protocol import RequestHandler

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


# Anthropic's error types by status (its API's documented ones, which its SDKs
# and clients read: `overloaded_error` is the one to retry later).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# vLLM's Anthropic Messages routes (`/v1/messages`, `/v1/messages/count_tokens`).
MESSAGES_PATH = "/v1/messages"
# A response that is Ferry's own error (not an instance's answer): its message.
OWN_ERROR = web.ResponseKey("ferry_own_error", str)


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict[str, object]:
    return {
        "error": {
            "message": message,
            # (Another 4xx is the request's fault too: 411, 414, 417.)
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
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
    headers: LooseHeaders | None = None,
) -> web.Response:
    response = web.Response(
        status=status,
        body=json.dumps(error_body(status, message, code=code, param=param)),
        content_type="application/json",
        headers=headers,
    )
    response[OWN_ERROR] = message
    return response


def anthropic_error_body(status: int, message: str) -> dict[str, object]:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_route(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


@web.middleware
async def anthropic_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Ferry's own errors on the Messages routes in Anthropic's shape, as vLLM
    answers its own there: Anthropic's clients read `error.message` and
    `error.type` from it. (An instance's answers pass as they came.)"""
    response = await handler(request)
    if anthropic_route(request.path) and (message := response.get(OWN_ERROR)) is not None:
        assert isinstance(response, web.Response)
        response.body = json.dumps(anthropic_error_body(response.status, message))
    return response


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn aiohttp's own HTTP errors (404 route, 405, 413), a body it cannot
    read (a chunked framing broken mid-way) and Ferry's own faults into the
    OpenAI shape."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason, headers=_keep_headers(exc))
    except web.RequestPayloadError as exc:
        why = getattr(exc.__cause__, "message", None) or str(exc)
        response = error_response(400, f"request body could not be read: {why}")
        # The rest of the body cannot be read either (else aiohttp reads on
        # after the answer, meets the same error and logs it as unhandled).
        end_unread(request, response)
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


def end_unread(request: web.Request, response: web.StreamResponse) -> None:
    """End the connection with `response`, the rest of the request's body
    unread: no more is taken from the socket, and aiohttp is told the body is
    over, so it does not read on in it after the answer."""
    response.force_close()
    if request.transport is not None:
        request.transport.pause_reading()
    request.content.feed_eof()


def _keep_headers(exc: web.HTTPException) -> dict[str, str]:
    return {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}


# The longest header line a client may send (a 20 KB JWT or cookie is taken by
# vLLM's server; aiohttp's default is 8 KiB), and the longest request line: one
# byte shorter, because aiohttp refuses either with the same LineTooLong,
# naming the limit it passed, and a long URL is a 414 where headers are a 431.
MAX_HEADER_LINE_BYTES = 64 * 1024
MAX_REQUEST_LINE_BYTES = MAX_HEADER_LINE_BYTES - 1


# How a request line's refusal begins: its URL (aiohttp's C parser quotes the
# URL), or its method and a space (the Python one quotes the line). A header
# line begins with its name and a colon, neither of these.
_REQUEST_LINE_START = re.compile(rb"/|\*|[A-Za-z][A-Za-z0-9+.-]*://|[!#$%&'*+.^_`|~0-9A-Za-z-]+ ")


def _request_line(exc: LineTooLong) -> bool:
    """Whether aiohttp refused the request line (not a header line) as too long:
    refused at the request line's limit, quoting a line that begins as one. (The
    Python parser holds a header line still coming to the request line's limit.)"""
    line, limit = exc.args[0], exc.args[1]
    if isinstance(line, str):
        line = line.encode("latin-1", "replace")
    return limit == MAX_REQUEST_LINE_BYTES and bool(_REQUEST_LINE_START.match(line))


class OpenAIErrorsRunner(web.AppRunner):
    """An AppRunner whose connections answer what aiohttp refuses before any
    middleware runs (a malformed request line or header, a broken chunked
    body, an unknown Transfer-Encoding) in the OpenAI shape, where aiohttp
    answers text/plain. The server it makes is aiohttp's, its handlers ours."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # (adds no state: the layout is aiohttp's)
        return server


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _RequestHandler(self, loop=self._loop, **self._kwargs)


class _RequestHandler(RequestHandler):
    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's logs it (and raises where an answer has begun).
        super().handle_error(request, status, exc, message)
        if status == 400 and isinstance(exc, LineTooLong) and _request_line(exc):
            status = 414
            message = f"request line over {MAX_REQUEST_LINE_BYTES} bytes: the URL is too long"
        elif status == 400 and (
            isinstance(exc, LineTooLong) or "Too many headers" in str(exc or "")
        ):
            status = 431
            message = "request headers too large: a line past the limit, or too many of them"
        if status >= 500 or not message:
            message = "internal error" if status >= 500 else "bad request"
        response = error_response(status, message.strip(), code="bad_http_request")
        response.force_close()  # as aiohttp's: the connection cannot be read on
        return response
