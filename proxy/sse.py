"""Server-sent events, the way both stream paths write them to the client.

One module for what the plain relay and a movable stream share: the upstream
failures that end a stream, splitting upstream bytes into events, framing,
finishing a response whose client may be gone, and TTFT/ITL timing.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import HttpVersion11, web
from multidict import CIMultiDict

from proxy import tap
from proxy.errors import anthropic_error_body, error_body
from proxy.metrics import FerryMetrics
from proxy.ttft_stages import TTFTStages

# Failures that happen before the instance produced anything: safe to retry elsewhere.
CONNECT_ERRORS = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
)
# Failures of a response already under way (a dead instance, a stalled one).
STREAM_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError)

DONE = b"data: [DONE]\n\n"
# How long the end of a stream's body may come after its last event: vLLM's
# comes at once; a server that leaves a finished stream open is not waited for.
BODY_END_GRACE_S = 1.0
EVENT_STREAM = "text/event-stream; charset=utf-8"  # as vLLM (FastAPI) says it


_BLANK = (b"\n", b"\r")
_BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark


class KeptAliveOnly(asyncio.TimeoutError):
    """An upstream sent only SSE comments (keep-alive pings, as sse-starlette's
    every 15 s) for as long as a silent socket may last: as hung as a silent one."""


class KeepAliveWatch:
    """Raises KeptAliveOnly once whole events have been nothing but comments
    or blank lines (one event a read, as pings come), or none at all (the bytes
    of an event trickling in that never ends), for `idle_s` (0: never)."""

    def __init__(self, idle_s: float, clock: Callable[[], float]) -> None:
        self.idle_s, self.clock = idle_s, clock
        self.last_event = clock()  # the last event that was more than a comment

    def progressed(self) -> None:
        """An event came that the client will not see (it is left out)."""
        self.last_event = self.clock()

    def saw(self, events: bytes) -> None:
        if events[:1] in _BLANK:
            events = events.lstrip(b"\r\n")
        if events and not events.startswith(b":"):
            self.last_event = self.clock()
        elif self.idle_s and self.clock() - self.last_event > self.idle_s:
            raise KeptAliveOnly(f"no event but keep-alives for {self.idle_s:g}s")


# A stream silent for STOPPED_GAPS of its usual token gaps, and at least
# STOPPED_FLOOR_S, has stopped producing (`TokenTiming.stopped`): decode gaps
# vary by a small factor with the batch, a preemption stops a stream for good.
STOPPED_GAPS = 4.0
STOPPED_FLOOR_S = 0.1


def dumps(obj: Any) -> bytes:
    """Compact JSON. orjson is 5-10x faster than json; what it refuses (integers
    past 64 bits, more than 254 levels, keys that are not strings) json writes."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    """JSON from an engine's event: orjson (4x faster than json), json for what
    orjson refuses (NaN, Infinity, integers past 64 bits); ValueError if neither reads it."""
    try:
        return orjson.loads(data)
    except ValueError:
        return json.loads(data)


def event(obj: Any) -> bytes:
    """One `data:` event."""
    return b"data: " + dumps(obj) + b"\n\n"


def error_event(status: int, message: str, code: str) -> bytes:
    """The event that ends a stream Ferry cannot finish (vLLM's own carry a code too)."""
    return event(error_body(status, message, code=code))


def anthropic_error_event(status: int, message: str) -> bytes:
    """The event that ends an Anthropic Messages stream Ferry cannot finish, named
    `error` as vLLM names the one that ends a Messages stream it fails: the
    `anthropic` SDK raises on it, and skips an unnamed one (a cut answer would
    read as whole)."""
    return b"event: error\n" + event(anthropic_error_body(status, message))


class AnswerTooLarge(aiohttp.ClientPayloadError):
    """An instance's answer, or one event of its stream, past `max_answer_bytes`:
    the call is given up as broken rather than held in memory."""


class Events:
    """An upstream stream's bytes, cut where events end: `take` gives what it
    has of whole events and keeps the rest. Line ends are made LF as they come:
    SSE allows CRLF (sse-starlette, in llama-cpp-python and other servers,
    sends it), LF and a lone CR, and events split on a blank line alike. An
    event that comes in many reads is kept as its parts and joined once, when
    it ends (no copy of it per read); one larger than `limit` bytes raises
    AnswerTooLarge. vLLM's reads end where its events do: they go through
    without a copy."""

    __slots__ = ("limit", "_parts", "_size", "_newline", "_cr", "_begun")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._parts: list[bytes] = []
        self._size = 0
        self._newline = False  # the bytes kept end a line: a blank line may follow
        self._cr = False  # the last read ended in CR, which may be half a CRLF
        self._begun = False  # bytes came: a byte order mark is only at the start

    def take(self, data: bytes) -> bytes:
        """Whole events (each with its blank line), or b"" until one ends."""
        if not self._begun and data:
            self._begun = True
            if data.startswith(_BOM):  # (SSE drops one; left, it hid the first event)
                data = data[len(_BOM) :]
        if self._cr or b"\r" in data:
            data = self._lf(data)
        if self._parts:
            if b"\n\n" not in data and not (self._newline and data[:1] == b"\n"):
                self._keep(data)
                return b""
            data = b"".join((*self._parts, data))
            self.clear()
        end = data.rfind(b"\n\n") + 2
        if end < 2:
            self._keep(data)
            return b""
        if end < len(data):
            self._keep(data[end:])
            return data[:end]
        return data

    def clear(self) -> None:
        self._parts, self._size, self._newline = [], 0, False

    def _lf(self, data: bytes) -> bytes:
        """`data` with CRLF and lone CR made LF; the LF of a CRLF cut between two
        reads is dropped from the second (the CR already ended the line)."""
        if not data:
            return data
        if self._cr and data[:1] == b"\n":
            data = data[1:]
        self._cr = data[-1:] == b"\r"
        return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def _keep(self, data: bytes) -> None:
        if not data:
            return
        self._parts.append(data)
        self._size += len(data)
        self._newline = data[-1:] == b"\n"
        if self._size > self.limit:
            size = self._size
            self.clear()
            raise AnswerTooLarge(f"an event of more than {size} bytes (max_answer_bytes)")


def data_of(event: bytes) -> bytes | None:
    """An event's data as SSE reads it: its `data:` lines, a space after the
    colon dropped, joined by newlines; None for an event without one (a comment,
    other fields only)."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # vLLM's every event: one line
    lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[1:] if line.startswith(b" ") else line for line in lines)


# How long a write may wait for a client that reads nothing (`server.
# client_send_timeout_s`, set on the app; 0 or unset: for ever). As nginx's
# `send_timeout`, it bounds the time between two reads of the client, not a
# whole write: a large write to a slow reader that keeps reading goes on.
SEND_TIMEOUT = web.AppKey("client_send_timeout_s", float)
# A write can wait for the client only once the socket's send buffer is past its
# high-water mark (64 KiB on uvloop and asyncio); below a quarter of it, it cannot.
_BACKLOG_BYTES = 16 * 1024


class _Client:
    """Where a stream's bytes go, for `write`: its socket and its send timeout."""

    __slots__ = ("transport", "timeout_s", "ending")

    def __init__(self, transport: asyncio.Transport | None, timeout_s: float) -> None:
        self.transport, self.timeout_s = transport, timeout_s
        self.ending = False  # `finish` began: its last bytes are on their way


_CLIENT = web.ResponseKey("ferry_client", _Client)  # a streamed response's `_Client`


def client_transport(response: web.StreamResponse) -> asyncio.Transport | None:
    """The socket of an open stream's client (None once it has none)."""
    client = response.get(_CLIENT)
    return None if client is None else client.transport


_OPEN = web.RequestKey("ferry_stream", web.StreamResponse)  # the stream a request opened
CUT = web.RequestKey("ferry_cut", bool)  # cancelled by a shutdown (proxy/shutdown.py)


def cancelled(request: web.Request) -> str:
    """The outcome of a request whose handler was cancelled."""
    return "shutdown" if request.get(CUT) else "client_disconnect"


async def open_response(
    request: web.Request,
    instance: str,
    events: bool = True,
    headers: CIMultiDict[str] | None = None,
) -> web.StreamResponse:
    """Open a stream to the client, with the instance's `headers` that go on
    (proxy/upstream.py's `answer_headers`). `events`: its bytes go out whole
    events at a time (Ferry's own streams, not a pass-through's), so that
    `end_cut` can end it with one."""
    sent = CIMultiDict(headers or ())
    sent["Content-Type"] = EVENT_STREAM
    sent.setdefault("Cache-Control", "no-cache")
    sent["x-ferry-instance"] = instance
    response = web.StreamResponse(headers=sent)
    if request.version < HttpVersion11:
        # HTTP/1.0 has no chunks: the connection's close ends the body.
        response.force_close()
    response[_CLIENT] = _Client(request.transport, request.app.get(SEND_TIMEOUT, 0.0))
    try:
        await response.prepare(request)
    except ConnectionResetError as exc:  # aiohttp's is a ClientConnectionError too
        raise ClientGone(str(exc)) from exc
    if events:
        request[_OPEN] = response
    return response


def end_cut(request: web.Request, message: str) -> None:
    """End the stream `request` opened, if it is still open, with a 503 error
    event and [DONE], so that its client knows it was cut (it retries) rather
    than read a stream that stops. Written at once: the caller's task is being
    cancelled and awaits nothing more."""
    response = request.get(_OPEN)
    client = None if response is None else response.get(_CLIENT)
    if response is None or client is None or client.ending:
        return  # none opened, or over (a byte more would start another answer)
    transport = client.transport
    if transport is None or transport.is_closing():
        return  # its client is gone
    body = error_event(503, message, "shutting_down") + DONE
    if tap.chunked(response):  # framed as aiohttp framed the rest, then the last chunk
        body = tap.http_chunk(body) + b"0\r\n\r\n"
    transport.write(body)


class ClientGone(ConnectionResetError):
    """The client went away while a stream wrote to it. aiohttp raises its
    ClientConnectionResetError there, which is also a ClientConnectionError and
    so would read as a broken upstream (one of STREAM_ERRORS) and start a failover
    for nobody; this one is not."""


async def write(response: web.StreamResponse, data: bytes) -> None:
    """Write stream bytes to the client; a client gone raises `ClientGone`, and so
    does one that read nothing for its send timeout (nginx's `send_timeout`):
    otherwise it would hold its request, and the instance's memory, for as long
    as it keeps the socket open."""
    client: _Client | None = response.get(_CLIENT)
    try:
        if (
            client is not None
            and client.timeout_s
            and client.transport is not None
            and client.transport.get_write_buffer_size() + len(data) > _BACKLOG_BYTES
        ):
            # Checked first, so the timer costs nothing while the client keeps up.
            await _write_watched(response, data, client.transport, client.timeout_s)
        else:
            await response.write(data)
    except ConnectionResetError as exc:
        raise ClientGone(str(exc)) from exc
    except TimeoutError as exc:
        assert client is not None
        _hang_up(client)
        raise ClientGone(f"the client read nothing for {client.timeout_s:g} s") from exc


async def _write_watched(
    response: web.StreamResponse, data: bytes, transport: asyncio.Transport, timeout_s: float
) -> None:
    """`response.write(data)`, which returns once the socket's buffer has drained;
    TimeoutError once the client has read nothing of it for `timeout_s`. (A
    timer on the whole write would cut a client reading steadily but slowly
    behind a large write: 500 KB of logprobs to a phone.)"""
    writing = asyncio.ensure_future(response.write(data))
    try:
        await asyncio.sleep(0)  # the write has put its bytes in the buffer
        left = transport.get_write_buffer_size()
        while True:
            done, _ = await asyncio.wait((writing,), timeout=timeout_s)
            if done:
                return writing.result()
            now = transport.get_write_buffer_size()
            if now >= left:  # nothing read since the last look
                raise TimeoutError
            left = now
    finally:
        if not writing.cancel() and not writing.cancelled():
            writing.exception()  # done: its error, if any, is this write's, seen


# A whole answer past this is written by Ferry, under the send timeout: aiohttp
# writes an answer a handler returns with no timeout, so a client that reads
# nothing would hold it (48 MB of embeddings, say) for as long as it keeps its
# socket open. Smaller ones the sockets' buffers take whole.
WHOLE_WATCHED_BYTES = 256 * 1024


async def send_whole(request: web.Request, answer: web.Response) -> tuple[web.StreamResponse, bool]:
    """Send a large whole `answer` now, as `write` sends a stream's bytes; the
    answer to return, and whether the client took it. A small one is left to
    aiohttp, as is any where no send timeout is set."""
    body = answer.body
    timeout_s = request.app.get(SEND_TIMEOUT, 0.0)
    if not timeout_s or not isinstance(body, bytes) or len(body) <= WHOLE_WATCHED_BYTES:
        return answer, True
    headers = CIMultiDict(answer.headers)
    headers.popall("Content-Length", None)
    response = web.StreamResponse(status=answer.status, reason=answer.reason, headers=headers)
    response.content_length = len(body)
    response[_CLIENT] = _Client(request.transport, timeout_s)
    try:
        await response.prepare(request)
    except ConnectionResetError:
        return response, False
    return response, await finish(response, body)


async def finish(response: web.StreamResponse, data: bytes | None = None) -> bool:
    """Write the last bytes and end a stream whose client may already be gone;
    whether they went out (False: the client was gone before `data`, or read
    nothing for its send timeout and was hung up on). A client gone before only
    the body's terminator had its stream: one that read [DONE] may close at once."""
    client: _Client | None = response.get(_CLIENT)
    timeout_s = client.timeout_s if client is not None and client.timeout_s else None
    if client is not None:
        client.ending = True
    try:
        if data:
            await write(response, data)
        async with asyncio.timeout(timeout_s):  # the terminator, a few bytes
            await response.write_eof()
    except ConnectionResetError:  # ClientGone too: gone, or hung up on by `write`
        return not data
    except TimeoutError:
        assert client is not None
        _hang_up(client)
        return False
    return True


def _hang_up(client: _Client) -> None:
    """Close the socket of a client that stopped reading: what is left in its
    buffer would wait for it for ever, and aiohttp ends the response with it."""
    if client.transport is not None:
        client.transport.abort()


class TokenTiming:
    """Records TTFT at the first token and inter-token gaps after it, labelled by
    `model` (a bounded label, see `FerryMetrics.model_label`) and the instance that
    produced the token; a move's downtime is the gap from the last token before
    the cut to the first after. With `stages`, the stream reports when it reads
    upstream bytes (`read`) and writes to the client (`written`) until its first
    token is out, and the TTFT's breakdown (proxy/ttft_stages.py) is recorded."""

    __slots__ = (
        "metrics",
        "clock",
        "arrived",
        "model",
        "last",
        "gap_s",
        "cut_at",
        "ttft",
        "stages",
        "stage_seconds",
        "_first_from",
    )

    def __init__(
        self,
        metrics: FerryMetrics,
        clock: Callable[[], float],
        arrived: float,
        model: str,
        stages: TTFTStages | None = None,
    ) -> None:
        self.metrics, self.clock, self.arrived, self.model = metrics, clock, arrived, model
        self.last: float | None = None
        self.gap_s: float | None = None  # its recent gap between token chunks (EWMA)
        self.cut_at: float | None = None
        self.ttft: float | None = None  # seconds, once the first token came
        self.stages = stages  # None once its breakdown is recorded
        self.stage_seconds: dict[str, float] | None = None  # the breakdown, once recorded
        self._first_from: str | None = None  # the first token's instance, until it is written

    @property
    def first_token_seen(self) -> bool:
        return self.last is not None

    def silent_s(self) -> float:
        """Seconds since the last token (0 before the first)."""
        return 0.0 if self.last is None else self.clock() - self.last

    def quiet_s(self) -> float:
        """Seconds since the last token, or since the request arrived before the first."""
        return self.clock() - (self.arrived if self.last is None else self.last)

    def stopped(self) -> bool:
        """Whether the stream has stopped producing: silent for several of its own
        recent gaps (at least STOPPED_FLOOR_S), as when its engine preempted it."""
        return self.stops_in() <= 0

    def stops_in(self) -> float:
        """Seconds until the stream counts as stopped if no token comes (0: it has;
        infinite before its first token)."""
        if self.last is None:
            return math.inf
        usual = STOPPED_GAPS * self.gap_s if self.gap_s is not None else 0.0
        return max(0.0, max(STOPPED_FLOOR_S, usual) - self.silent_s())

    def cut(self) -> None:
        """A move starts: the next token's gap is downtime."""
        self.cut_at = self.last if self.last is not None else self.clock()

    def uncut(self) -> None:
        self.cut_at = None

    @property
    def resuming(self) -> bool:
        """A move's continuation has not sent its first token yet: the engine it
        went to queues it (or prefills it) like any new request."""
        return self.cut_at is not None

    def read(self) -> None:
        """Upstream bytes were read (only the first token's matter)."""
        if self.stages is not None:
            self.stages.read()

    def written(self) -> None:
        """Bytes went to the client: if they held the first token, its TTFT and
        breakdown are done (what the client waited for includes the answer's
        headers and the write)."""
        if self._first_from is not None:
            self.ttft = self.clock() - self.arrived
            self.metrics.ttft.labels(self.model, self._first_from).observe(self.ttft)
            self._first_from = None
        stages = self.stages
        if stages is not None and self.last is not None:
            self.stages = None
            seconds = stages.seconds(self.clock())
            if seconds is not None:
                self.stage_seconds = seconds
                for stage, value in seconds.items():
                    self.metrics.ttft_stage[stage].observe(value)

    def token(self, instance: str) -> float | None:
        """A token chunk from `instance` reached the client; the downtime it ended
        (seconds), if it is the first after a move of a stream that had streamed.
        A move before the first token pauses nothing inside the stream: its wait
        is the stream's TTFT, counted there."""
        now = self.clock()
        downtime = None
        if self.cut_at is not None:
            if self.last is not None:
                downtime = now - self.cut_at
                self.metrics.migration_downtime.observe(downtime)
            self.cut_at = None
        if self.last is None:
            self._first_from = instance  # its TTFT is taken when it is written
            if self.stages is not None:
                self.stages.first_token()
        else:
            gap = now - self.last
            self.metrics.itl.labels(self.model, instance).observe(gap)
            if downtime is None:  # a move's downtime is not the engine's pace
                self.gap_s = gap if self.gap_s is None else self.gap_s + 0.25 * (gap - self.gap_s)
        self.last = now
        return downtime
