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
    """A client socket with `buffered` bytes waiting for it; it reads none."""

    buffered = 1 << 20

    def abort(self) -> None:
        Stalled.aborted = True

    def get_write_buffer_size(self) -> int:
        return self.buffered


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


class SlowReader(dict[Any, Any]):
    """A client reading a large write steadily, slower than the send timeout
    allows for the whole of it: 16 KiB every 30 ms, 1 MiB in ~2 s."""

    def __init__(self, transport: Transport) -> None:
        super().__init__()
        self.transport = transport

    async def write(self, data: bytes) -> None:
        self.transport.buffered = len(data)
        while self.transport.buffered > 16 * 1024:  # aiohttp's drain: down to the low mark
            await asyncio.sleep(0.03)
            self.transport.buffered -= 16 * 1024


def test_a_client_that_reads_a_large_write_slowly_but_steadily_is_not_cut() -> None:
    """nginx's `send_timeout`: the time between two reads, not for the whole write."""
    transport = Transport()
    reader: Any = SlowReader(transport)
    reader[sse._CLIENT] = sse._Client(transport, 0.5)  # type: ignore[arg-type]
    took = asyncio.run(_timed(sse.write(reader, b"x" * (1 << 20))))
    assert took > 1.0  # longer than the timeout, and it went through


def test_a_client_that_stops_reading_midway_is_cut_after_the_timeout() -> None:
    transport = Transport()

    class Stops(SlowReader):
        async def write(self, data: bytes) -> None:
            self.transport.buffered = len(data)
            for _ in range(5):  # reads a little, then nothing
                await asyncio.sleep(0.03)
                self.transport.buffered -= 16 * 1024
            await asyncio.sleep(3600)

    stops: Any = Stops(transport)
    stops[sse._CLIENT] = sse._Client(transport, 0.2)  # type: ignore[arg-type]
    Stalled.aborted = False
    with pytest.raises(sse.ClientGone, match="read nothing for 0.2 s"):
        asyncio.run(sse.write(stops, b"x" * (1 << 20)))
    assert Stalled.aborted


async def _timed(write: Any) -> float:
    loop = asyncio.get_running_loop()
    began = loop.time()
    await write
    return loop.time() - began
