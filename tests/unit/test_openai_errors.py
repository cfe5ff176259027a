"""Ferry's own faults reach the client in the OpenAI shape, never as aiohttp's
text/plain 500; one whose answer had begun is left to cut the connection."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.test_utils import TestClient, TestServer

from proxy.errors import (
    MAX_HEADER_LINE_BYTES,
    MAX_REQUEST_LINE_BYTES,
    _request_line,
    openai_errors,
)


async def broken(request: web.Request) -> web.StreamResponse:
    raise KeyError("a fault of the proxy's own")


async def broken_midway(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    await response.write(b"data: 1\n\n")
    raise KeyError("after the answer began")


def test_a_fault_of_ferrys_own_is_an_openai_error(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> tuple[int, dict[str, dict[str, str]], str, bool]:
        app = web.Application(middlewares=[openai_errors])
        app.router.add_get("/broken", broken)
        app.router.add_get("/midway", broken_midway)
        async with TestClient(TestServer(app)) as client:
            answer = await client.get("/broken")
            status, body = answer.status, await answer.json()
            midway = await client.get("/midway")
            try:
                text = (await midway.read()).decode()
                cut = False
            except aiohttp.ClientPayloadError:
                text, cut = "", True
            return status, body, text, cut

    with caplog.at_level(logging.ERROR, "ferry.errors"):
        status, body, text, cut = asyncio.run(scenario())
    assert status == 500
    assert body["error"]["code"] == "internal_error" and "KeyError" in body["error"]["message"]
    assert "proxy's own" not in body["error"]["message"]  # the detail goes to the log only
    assert "GET /broken failed" in caplog.text and "a fault of the proxy's own" in caplog.text
    assert cut and "error" not in text  # no second answer after the first began


@pytest.mark.parametrize(
    "status,kind",
    [(411, "invalid_request_error"), (417, "invalid_request_error"), (500, "server_error")],
)
def test_a_status_with_no_type_of_its_own_is_the_client_s_or_the_server_s(
    status: int, kind: str
) -> None:
    """A 417 (an `Expect` Ferry does not meet) said `server_error`."""
    from proxy.errors import error_body

    assert error_body(status, "x")["error"]["type"] == kind


@pytest.mark.parametrize(
    ("quoted", "limit", "url"),
    [
        (b"/v1/models?x=aaaa...", MAX_REQUEST_LINE_BYTES, True),  # C parser: the URL
        (b"http://ferry/v1/models?x=aa...", MAX_REQUEST_LINE_BYTES, True),
        (b"GET /v1/models?x=aaaa...", MAX_REQUEST_LINE_BYTES, True),  # Python parser: the line
        # The Python parser, a header line whose end has not come yet: it
        # checks it at the request line's limit.
        (b"x-long: aaaa...", MAX_REQUEST_LINE_BYTES, False),
        (b"Authorization: Bearer aaaa...", MAX_REQUEST_LINE_BYTES, False),
        (b"Bearer aaaa...", MAX_HEADER_LINE_BYTES, False),  # C parser: a header's value
        (b"/path-like value...", MAX_HEADER_LINE_BYTES, False),
    ],
)
def test_a_line_too_long_is_the_url_only_where_it_is_the_request_line(
    quoted: bytes, limit: int, url: bool
) -> None:
    """A 414 for the request line, a 431 for a header line: aiohttp refuses
    both with LineTooLong, and its Python parser holds a header line still
    coming to the request line's limit (it answered 414 for a long header)."""
    assert _request_line(LineTooLong(quoted, limit)) is url
