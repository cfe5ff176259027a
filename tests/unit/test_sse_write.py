"""Writing to a client that left is not an upstream that broke."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from proxy import sse


class Departed(dict[Any, Any]):
    """A response (a mapping, as aiohttp's are) whose client has gone: aiohttp's
    writer raises this."""

    async def write(self, data: bytes) -> None:
        raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")

    async def write_eof(self) -> None:
        raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")


def test_a_write_to_a_departed_client_is_not_a_stream_error() -> None:
    response: Any = Departed()
    with pytest.raises(sse.ClientGone) as caught:
        asyncio.run(sse.write(response, b"data: {}\n\n"))
    assert not isinstance(caught.value, sse.STREAM_ERRORS)  # no failover for nobody
    assert isinstance(caught.value, ConnectionResetError)  # a client disconnect


class Stalled(dict[Any, Any]):
    """A response whose client reads nothing: its last write never completes."""

    aborted = False

    async def write(self, data: bytes) -> None:
        await asyncio.sleep(3600)

    async def write_eof(self) -> None:
        await asyncio.sleep(3600)


class Transport:
    def abort(self) -> None:
        Stalled.aborted = True


def test_a_stream_end_the_client_never_takes_is_not_delivered() -> None:
    """`finish` says whether the client took the end, so a stream whose client
    stalled at its last bytes is counted a client gone, not ok."""
    stalled: Any = Stalled()
    stalled[sse._CLIENT] = sse._Client(Transport(), 0.05)  # type: ignore[arg-type]
    assert asyncio.run(sse.finish(stalled, b"data: [DONE]\n\n")) is False
    assert Stalled.aborted  # the socket was hung up on
    assert asyncio.run(sse.finish(Departed(), b"data: [DONE]\n\n")) is False
    # Gone before only the body's terminator: it read the whole stream, [DONE]
    # and all, and closed at once, as clients may.
    assert asyncio.run(sse.finish(Departed())) is True


def test_a_stream_end_the_client_takes_is_delivered() -> None:
    class Taken(dict[Any, Any]):
        async def write(self, data: bytes) -> None:
            pass

        async def write_eof(self) -> None:
            pass

    assert asyncio.run(sse.finish(Taken(), b"data: [DONE]\n\n")) is True
