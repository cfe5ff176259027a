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


def test_a_write_to_a_departed_client_is_not_a_stream_error() -> None:
    response: Any = Departed()
    with pytest.raises(sse.ClientGone) as caught:
        asyncio.run(sse.write(response, b"data: {}\n\n"))
    assert not isinstance(caught.value, sse.STREAM_ERRORS)  # no failover for nobody
    assert isinstance(caught.value, ConnectionResetError)  # a client disconnect
