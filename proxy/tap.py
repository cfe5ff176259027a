"""Relaying a stream's chunks from inside the upstream connection's callback.

Read the usual way, each chunk an instance sends wakes the relaying task: the
socket callback stores the bytes in aiohttp's StreamReader and resolves a future,
then the task is scheduled, resumes through `readany()` and writes through the
response's coroutines. A tapped reader gives each chunk to a function where it
arrives, which relays it and writes it to the client's socket at once; the task
sleeps in `readany()` until the stream ends, breaks, or the tap declines a chunk.
At 200 streams of token-sized chunks that saves a tenth to a fifth of the
proxy's CPU per token, and under a start burst most of its added TTFT (the
chunks no longer queue behind one another's task wakes;
`loadtest/bench_overhead.py --baseline`).

A chunk is tapped only while the task is parked in `readany()` with nothing
buffered: otherwise the task holds bytes or state the chunk must follow (it
is writing, or in the middle of a read whose flow control re-enters the
parser, or has been cancelled). The tap also declines a chunk while the
client's socket holds a backlog or is closing. A declined chunk is buffered
and read the usual way, so the task's path runs: its back-pressure, send
timeout and client-gone handling. What the function raises is put on the
reader, so the task's `readany()` raises it as if the task had run the
function itself.

It leans on how aiohttp's StreamReader keeps its buffer (`_buffer`, `_cursor`,
the ends of HTTP chunks); a reader without them is not tapped, and
tests/unit/test_tap.py runs a tap on aiohttp's own parser and sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import hdrs
from aiohttp.streams import StreamReader
from aiohttp.web import StreamResponse

# A backlog on the client's socket past this sends chunks back to the task,
# whose writes wait for the client (proxy/sse.py's `write`).
BACKLOG_BYTES = 16 * 1024

_TAPS: dict[int, Tap] = {}  # by id() of a tapped reader


class Tap:
    """Where a tapped reader's chunks go: `relay` turns them into the bytes the
    client is sent, written straight to `transport` (chunk-framed if `chunked`);
    `wrote` is called with them after each chunk it relayed, written or empty."""

    __slots__ = ("relay", "transport", "chunked", "wrote")

    def __init__(
        self,
        relay: Callable[[bytes], bytes],
        transport: asyncio.Transport,
        chunked: bool,
        wrote: Callable[[bytes], None],
    ) -> None:
        self.relay, self.transport, self.chunked, self.wrote = relay, transport, chunked, wrote

    def take(self, data: bytes) -> bool:
        """Relay `data` and write it; False where the task must (a backlog)."""
        transport = self.transport
        if transport.is_closing() or transport.get_write_buffer_size() > BACKLOG_BYTES:
            return False
        out = self.relay(data)
        if out:
            transport.write(http_chunk(out) if self.chunked else out)
        self.wrote(out)
        return True


class _TappedReader(StreamReader):
    """A StreamReader whose chunks go to its `Tap` while it has one. The class
    of a reader is switched to this one and back; it adds no state, so its
    instances are laid out as StreamReader's are. A chunk the tap takes counts
    as read (the reader's cursor passes it), so the end of its HTTP chunk marks
    nothing and wakes no one."""

    __slots__ = ()

    def feed_data(self, data: bytes, size: int = 0) -> bool:
        tap = _TAPS.get(id(self))
        waiter = self._waiter  # the task parked in readany()
        if tap is None or waiter is None or waiter.done() or self._buffer or not data:
            return super().feed_data(data, size)
        try:
            taken = tap.take(data)
        except Exception as exc:  # the task's to handle, as if it had run the tap
            del _TAPS[id(self)]  # and nothing after it is relayed
            self._taken(len(data))
            # The body's end, if it comes, still hands the connection back to
            # the pool: a stream whose last event ended it ([DONE]) is no failure.
            callbacks = list(self._eof_callbacks)
            self.set_exception(exc)
            self._eof_callbacks.extend(callbacks)
            return False
        if not taken:
            return super().feed_data(data, size)
        self._taken(len(data))
        return False

    def _taken(self, size: int) -> None:
        self.total_bytes += size
        self._cursor += size

    def end_http_chunk_receiving(self) -> None:
        if self._buffer or id(self) not in _TAPS:
            super().end_http_chunk_receiving()


def attach_to(
    reader: StreamReader,
    response: StreamResponse,
    transport: asyncio.Transport | None,
    relay: Callable[[bytes], bytes],
    wrote: Callable[[bytes], None],
) -> None:
    """Tap `reader` for `response`, open (its headers sent) on `transport`, where
    it can be: a plain StreamReader, and a body written as is or chunk-framed
    (not compressed). Every write to `response` must be done before its first
    await (aiohttp's are, without compression), or the tap's could overtake it."""
    if (
        type(reader) is not StreamReader
        or not hasattr(reader, "_cursor")
        or transport is None
        or response.compression
    ):
        return
    reader.__class__ = _TappedReader
    _TAPS[id(reader)] = Tap(relay, transport, chunked(response), wrote)


def chunked(response: StreamResponse) -> bool:
    """Whether aiohttp frames the open response's body in HTTP chunks."""
    return response.headers.get(hdrs.TRANSFER_ENCODING) == "chunked"


def http_chunk(data: bytes) -> bytes:
    """`data` framed as one HTTP/1.1 chunk, as aiohttp frames a write."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def detach(reader: StreamReader) -> None:
    _TAPS.pop(id(reader), None)
    if type(reader) is _TappedReader:
        reader.__class__ = StreamReader  # type: ignore[assignment]  # narrowed above
