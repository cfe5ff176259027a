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

Where the instance's body comes in plain HTTP chunks, the tap also reads them
itself (`_Frames`): aiohttp would take each one through its protocol's
`data_received`, its parser and three calls back into the reader, and move the
connection's read timer: about 5 us a chunk, against 2.5 us here (a loop of
`data_received` calls on one protocol, uvloop, with the tap's relay the identity).

It leans on how aiohttp's StreamReader keeps its buffer (`_buffer`, `_cursor`,
the ends of HTTP chunks) and how its client protocol keeps its read timer; a
reader without them is not tapped, and tests/unit/test_tap.py runs a tap on
aiohttp's own parser and sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from aiohttp import hdrs
from aiohttp.client_proto import ResponseHandler
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

    __slots__ = ("relay", "transport", "chunked", "wrote", "frames", "chunk_ended")

    def __init__(
        self,
        relay: Callable[[bytes], bytes],
        transport: asyncio.Transport,
        chunked: bool,
        wrote: Callable[[bytes], None],
    ) -> None:
        self.relay, self.transport, self.chunked, self.wrote = relay, transport, chunked, wrote
        self.frames: _Frames | None = None  # where the tap reads the HTTP chunks itself
        # Whether aiohttp's parser last told the reader of a chunk's end (not of
        # a chunk's start or bytes): `_Frames` learns from it where the parser is.
        self.chunk_ended = False

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
        if tap is None:
            return super().feed_data(data, size)
        tap.chunk_ended = False
        if not data or not _relayed(self, tap, data):
            return super().feed_data(data, size)
        return False

    def begin_http_chunk_receiving(self) -> None:
        tap = _TAPS.get(id(self))
        if tap is not None:
            tap.chunk_ended = False
        super().begin_http_chunk_receiving()

    def end_http_chunk_receiving(self) -> None:
        tap = _TAPS.get(id(self))
        if tap is not None:
            tap.chunk_ended = True
        if self._buffer or tap is None:
            super().end_http_chunk_receiving()


def _relayed(reader: StreamReader, tap: Tap, data: bytes) -> bool:
    """Relay `data` by `tap` and count it read; False where the task must read
    it (it is not parked in `readany()` with nothing buffered, or the tap
    declined). What the tap raises goes on the reader for the task, and nothing
    after it is relayed."""
    waiter = reader._waiter
    if waiter is None or waiter.done() or reader._buffer:
        return False
    try:
        taken = tap.take(data)
    except Exception as exc:  # the task's to handle, as if it had run the tap
        _stop(reader)
        reader.total_bytes += len(data)
        reader._cursor += len(data)
        # The body's end, if it comes, still hands the connection back to
        # the pool: a stream whose last event ended it ([DONE]) is no failure.
        callbacks = list(reader._eof_callbacks)
        reader.set_exception(exc)
        reader._eof_callbacks.extend(callbacks)
        return True
    if taken:
        reader.total_bytes += len(data)
        reader._cursor += len(data)
    return taken


_HEX = b"0123456789abcdefABCDEF"


class _Frames:
    """Reads a tapped connection's HTTP chunks in place of aiohttp: installed as
    its protocol's `data_received`, it hands a read of whole chunks to the tap
    one by one. Anything else (a chunk cut between reads, an extension, the
    last chunk and what follows it, bytes that are not HTTP, a chunk the task
    must read) goes to aiohttp's `data_received` as it came, and only from
    where aiohttp's parser is between two chunks (`between`): its state is then
    what it would be had it read every byte, and it reads the body's end, its
    errors and the rest as ever. It keeps the connection's read timeout
    (`sock_read`) by a timer that looks again when due rather than one made
    anew for every read."""

    __slots__ = ("reader", "tap", "protocol", "theirs", "between", "heard", "timer")

    def __init__(self, reader: StreamReader, tap: Tap, protocol: ResponseHandler) -> None:
        # `tap` reads through this one while it is its `frames` (`_stop` ends that).
        self.reader, self.tap, self.protocol = reader, tap, protocol
        self.theirs = protocol.data_received  # aiohttp's
        # Not known at first (the task's last read may have ended in a chunk):
        # learnt from aiohttp's next read.
        self.between = False
        self.heard = 0.0  # the loop's time of the last read taken here
        self.timer: asyncio.TimerHandle | None = None  # the read timeout's, while it is ours

    def data_received(self, data: bytes) -> None:
        reader, tap = self.reader, self.tap
        at = 0
        if self.between and tap.frames is self:
            size = len(data)
            while at < size:
                eol = data.find(b"\r\n", at, at + 10)  # (8 hex digits at most)
                digits = data[at:eol]
                if eol < 0 or not digits or digits.strip(_HEX):
                    break
                start = eol + 2
                end = start + int(digits, 16)
                if end == start or end + 2 > size or data[end : end + 2] != b"\r\n":
                    break  # the last chunk, a chunk cut short, or not HTTP
                if not _relayed(reader, tap, data[start:end]):
                    break
                at = end + 2
                if tap.frames is not self:  # it raised: nothing after is relayed
                    break
            if at and tap.frames is self:
                self._heard()
        if at < len(data) or not data:  # (b"": aiohttp resumes its parser, paused
            # with a read's rest in it, after the task drained a backlog)
            self.theirs(data[at:] if at else data)
            self.between = tap.frames is self and tap.chunk_ended and data.endswith(b"\r\n")

    def _heard(self) -> None:
        protocol = self.protocol
        timeout = protocol.read_timeout
        if not timeout:
            return
        loop = protocol._loop
        self.heard = loop.time()
        if protocol._read_timeout_handle is not self.timer:  # aiohttp's: take it over
            if protocol._read_timeout_handle is not None:
                protocol._read_timeout_handle.cancel()
            self.timer = protocol._read_timeout_handle = loop.call_at(
                self.heard + timeout, self._due
            )

    def _due(self) -> None:
        protocol = self.protocol
        if protocol._read_timeout_handle is not self.timer or not protocol.read_timeout:
            return
        due = self.heard + protocol.read_timeout
        loop = protocol._loop
        if loop.time() < due:  # heard from since it was set
            self.timer = protocol._read_timeout_handle = loop.call_at(due, self._due)
        else:
            protocol._on_read_timeout()

    def stop(self) -> None:
        """Hand the connection's reads back to aiohttp (the body ended, or the
        tap did), before the connection can go back to the pool."""
        protocol = self.protocol
        if protocol.__dict__.get("data_received") != self.data_received:
            return  # stopped already (the connection may be another stream's now)
        del protocol.data_received
        transport = protocol.transport
        if transport is not None:
            transport.set_protocol(protocol)  # (uvloop keeps the method it calls)
        if self.timer is not None and protocol._read_timeout_handle is self.timer:
            self.timer.cancel()
            protocol._read_timeout_handle = None
            if not self.reader.at_eof():
                protocol._reschedule_timeout()  # aiohttp's own timer again


def _read_frames(reader: StreamReader, tap: Tap, upstream: aiohttp.ClientResponse) -> None:
    """Read `upstream`'s HTTP chunks for `tap` (`_Frames`) where its body comes
    in them as they are: chunked, not compressed, on a plain TCP connection."""
    protocol = getattr(reader, "_protocol", None)
    transport = getattr(protocol, "transport", None)
    headers = upstream.headers
    if (
        not isinstance(protocol, ResponseHandler)
        or transport is None
        or transport.get_extra_info("sslcontext") is not None
        or headers.get(hdrs.TRANSFER_ENCODING, "").lower() != "chunked"
        or hdrs.CONTENT_ENCODING in headers
        or not hasattr(protocol, "_read_timeout_handle")
        or "data_received" in protocol.__dict__
    ):
        return
    frames = tap.frames = _Frames(reader, tap, protocol)
    protocol.data_received = frames.data_received  # type: ignore[method-assign]
    transport.set_protocol(protocol)
    reader.on_eof(frames.stop)


def attach_to(
    reader: StreamReader,
    response: StreamResponse,
    transport: asyncio.Transport | None,
    relay: Callable[[bytes], bytes],
    wrote: Callable[[bytes], None],
    upstream: aiohttp.ClientResponse | None = None,
) -> None:
    """Tap `reader` for `response`, open (its headers sent) on `transport`, where
    it can be: a plain StreamReader, and a body written as is or chunk-framed
    (not compressed). Every write to `response` must be done before its first
    await (aiohttp's are, without compression), or the tap's could overtake it.
    With the `upstream` response whose body `reader` is, its HTTP chunks are
    read here too where they can be (`_Frames`)."""
    if (
        type(reader) is not StreamReader
        or not hasattr(reader, "_cursor")
        or transport is None
        or response.compression
    ):
        return
    reader.__class__ = _TappedReader
    tap = _TAPS[id(reader)] = Tap(relay, transport, chunked(response), wrote)
    if upstream is not None:
        _read_frames(reader, tap, upstream)


def chunked(response: StreamResponse) -> bool:
    """Whether aiohttp frames the open response's body in HTTP chunks."""
    return response.headers.get(hdrs.TRANSFER_ENCODING) == "chunked"


def http_chunk(data: bytes) -> bytes:
    """`data` framed as one HTTP/1.1 chunk, as aiohttp frames a write."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def detach(reader: StreamReader) -> None:
    _stop(reader)
    if type(reader) is _TappedReader:
        reader.__class__ = StreamReader  # type: ignore[assignment]  # narrowed above


def _stop(reader: StreamReader) -> None:
    """Relay nothing more of `reader`; aiohttp reads its connection again."""
    tap = _TAPS.pop(id(reader), None)
    if tap is not None and tap.frames is not None:
        tap.frames.stop()
        tap.frames = None
