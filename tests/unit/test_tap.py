"""A tapped reader relays chunks where they arrive, and hands the task what it
must handle itself: a backlog, a failure, the end."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import uvloop
from aiohttp import web
from aiohttp.client_proto import ResponseHandler
from aiohttp.streams import StreamReader
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import tap


class Protocol:
    """What a StreamReader asks of its connection."""

    connected = True
    paused = 0

    def pause_reading(self) -> None:
        self.paused += 1

    def resume_reading(self, resume_parser: bool = True) -> None:
        pass


class Transport:
    """A client's socket: what is written, and a backlog to set."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.backlog = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def get_write_buffer_size(self) -> int:
        return self.backlog

    def is_closing(self) -> bool:
        return self.closing


class Open(dict[Any, Any]):
    """An open response, as attach_to reads one."""

    compression = False

    def __init__(self, chunked: bool) -> None:
        super().__init__()
        self.headers = {"Transfer-Encoding": "chunked"} if chunked else {}


def tapped(
    relay: Any = bytes.upper, chunked: bool = True
) -> tuple[StreamReader, Transport, list[bytes], Protocol]:
    protocol = Protocol()
    reader = StreamReader(protocol, 2**16)  # type: ignore[arg-type]
    reader.begin_http_chunk_receiving()
    transport = Transport()
    wrote: list[bytes] = []
    response: Any = Open(chunked)
    tap.attach_to(reader, response, transport, relay, wrote.append)  # type: ignore[arg-type]
    return reader, transport, wrote, protocol


def feed(reader: StreamReader, data: bytes) -> None:
    """One HTTP chunk, as aiohttp's parser hands it over."""
    reader.feed_data(data)
    reader.end_http_chunk_receiving()


async def serve(handler: Any) -> tuple[web.AppRunner, int]:
    """A real aiohttp server of `handler` at GET /, on a free port."""
    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def streaming(chunks: list[bytes], every: int, pause_s: float) -> Any:
    """An upstream handler that writes `chunks`, pausing after each `every`-th."""

    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for i, chunk in enumerate(chunks):
            await response.write(chunk)
            if i % every == 0:
                await asyncio.sleep(pause_s)
        await response.write_eof()
        return response

    return upstream


async def parked(reader: StreamReader) -> asyncio.Future[bytes]:
    """The task's read, waiting for bytes (a tap relays only then)."""
    waiting = asyncio.ensure_future(reader.readany())
    await asyncio.sleep(0)
    return waiting


def test_chunks_go_to_the_client_framed_and_the_task_sleeps() -> None:
    async def main() -> None:
        reader, transport, wrote, protocol = tapped()
        waiting = await parked(reader)
        for _ in range(10_000):  # past the reader's count of chunks that pauses reading
            feed(reader, b"data: a\n\n")
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing woke the task
        assert transport.written[0] == b"9\r\nDATA: A\n\n\r\n"
        assert len(transport.written) == len(wrote) == 10_000
        assert protocol.paused == 0
        reader.feed_eof()
        assert await waiting == b""
        tap.detach(reader)
        assert type(reader) is StreamReader

    asyncio.run(main())


def test_a_body_not_chunked_goes_as_it_is() -> None:
    async def main() -> None:
        reader, transport, _, _ = tapped(chunked=False)
        await parked(reader)
        feed(reader, b"data: a\n\n")
        assert transport.written == [b"DATA: A\n\n"]
        tap.detach(reader)

    asyncio.run(main())


def test_nothing_to_send_writes_nothing() -> None:
    async def main() -> None:
        reader, transport, wrote, _ = tapped(relay=lambda data: b"")
        await parked(reader)
        feed(reader, b"data: half an ev")
        assert transport.written == []
        assert wrote == [b""]  # told all the same: the chunk was taken
        tap.detach(reader)

    asyncio.run(main())


@pytest.mark.parametrize("task", ["busy", "cancelled"])
def test_a_chunk_the_task_is_not_waiting_for_is_the_tasks(task: str) -> None:
    """While the task is not parked in its read (it writes, or is amid a read
    whose flow control feeds the parser again, or it was cancelled), a chunk
    relayed at once could overtake what the task holds: it is buffered."""

    async def main() -> None:
        reader, transport, wrote, _ = tapped()
        if task == "cancelled":
            waiting = await parked(reader)
            waiting.cancel()
        feed(reader, b"data: a\n\n")
        assert transport.written == wrote == []
        assert await reader.readany() == b"data: a\n\n"
        tap.detach(reader)

    asyncio.run(main())


@pytest.mark.parametrize("why", ["backlog", "closing"])
def test_a_client_behind_or_gone_hands_the_chunk_to_the_task(why: str) -> None:
    """The task's writes wait for the client (and time out on it), or see it
    gone; the chunk is not lost, and the ones after it wait behind it."""

    async def main() -> None:
        reader, transport, _, _ = tapped()
        waiting = await parked(reader)
        feed(reader, b"one ")
        if why == "backlog":
            transport.backlog = tap.BACKLOG_BYTES + 1
        else:
            transport.closing = True
        feed(reader, b"two ")
        transport.backlog, transport.closing = 0, False
        feed(reader, b"three ")  # bytes are waiting: it queues behind them
        assert transport.written == [b"4\r\nONE \r\n"]
        assert await waiting == b"two three "
        await parked(reader)
        feed(reader, b"four")  # nothing waits now: tapped again
        assert transport.written[-1] == b"4\r\nFOUR\r\n"
        tap.detach(reader)

    asyncio.run(main())


def test_what_the_relay_raises_the_task_reads() -> None:
    class Broken(Exception):
        pass

    def relay(data: bytes) -> bytes:
        raise Broken(data.decode())

    async def main() -> None:
        reader, transport, _, _ = tapped(relay=relay)
        waiting = asyncio.ensure_future(reader.readany())
        await asyncio.sleep(0)
        feed(reader, b"bad")
        with pytest.raises(Broken, match="bad"):
            await waiting
        feed(reader, b"after")  # a broken stream relays nothing more
        assert transport.written == []
        tap.detach(reader)

    asyncio.run(main())


def test_only_a_plain_reader_and_an_uncompressed_body_are_tapped() -> None:
    async def main() -> None:
        transport: Any = Transport()
        compressed: Any = Open(True)
        compressed.compression = True
        reader = StreamReader(Protocol(), 2**16)  # type: ignore[arg-type]
        tap.attach_to(reader, compressed, transport, bytes.upper, print)
        assert type(reader) is StreamReader
        tap.attach_to(reader, Open(True), None, bytes.upper, print)  # type: ignore[arg-type]
        assert type(reader) is StreamReader

    asyncio.run(main())


def test_a_real_connection_relays_every_byte_through_the_tap() -> None:
    """Against aiohttp's own parser and socket: many small HTTP chunks, each
    taken by the tap, none left for the task but the end."""
    chunks = [f"data: {i} 你好 🚀\n\n".encode() for i in range(6000)]
    upstream = streaming(chunks, every=500, pause_s=0.001)  # the reader catches up at times

    async def main() -> None:
        runner, port = await serve(upstream)
        transport = Transport()
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{port}/") as got,
            ):
                first = await got.content.readany()
                tap.attach_to(got.content, Open(False), transport, bytes, lambda out: None)  # type: ignore[arg-type]
                rest = []
                while data := await asyncio.wait_for(got.content.readany(), 10):
                    rest.append(data)  # what a backlog or a split left to the task
                tap.detach(got.content)
        finally:
            await runner.cleanup()
        assert first + b"".join(transport.written) + b"".join(rest) == b"".join(chunks)
        assert len(transport.written) > len(rest)

    asyncio.run(main())


def test_a_stream_the_tap_ended_hands_its_connection_back() -> None:
    """A relay that raises at the stream's last event (LiveStream's end of a
    pump) leaves the connection to the pool once its body ends: the next
    request reuses it."""
    ports: list[int] = []

    class Over(Exception):
        pass

    def relay(data: bytes) -> bytes:
        if b"[DONE]" in data:
            raise Over
        return data

    async def upstream(request: web.Request) -> web.StreamResponse:
        ports.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        response = web.StreamResponse()
        await response.prepare(request)
        for chunk in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
            await response.write(chunk)
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response

    async def main() -> None:
        runner, port = await serve(upstream)
        try:
            async with aiohttp.ClientSession() as session:
                for _ in range(2):
                    transport = Transport()
                    got = await session.get(f"http://127.0.0.1:{port}/")
                    assert await got.content.readany() == b"data: 1\n\n"
                    tap.attach_to(got.content, Open(False), transport, relay, lambda out: None)  # type: ignore[arg-type]
                    with pytest.raises(Over):
                        await got.content.readany()
                    tap.detach(got.content)
                    await asyncio.sleep(0.05)  # the body's end comes after its last event
                    got.close()
                    assert transport.written == [b"data: 2\n\n"]
        finally:
            await runner.cleanup()
        assert len(ports) == 2 and ports[0] == ports[1]

    asyncio.run(main())


# Where the tap reads the instance's HTTP chunks itself (`tap._Frames`).


class Upstream:
    """An instance's answer, as attach_to reads its framing."""

    def __init__(self, **headers: str) -> None:
        self.headers = {"Transfer-Encoding": "chunked", **headers}


class Socket:
    """The instance's connection under aiohttp's protocol."""

    def __init__(self) -> None:
        self.protocols: list[Any] = []

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def set_protocol(self, protocol: Any) -> None:
        self.protocols.append(protocol)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def framed_answer(payloads: list[bytes]) -> bytes:
    return b"".join(tap.http_chunk(p) for p in payloads) + b"0\r\n\r\n"


async def instance_answer(read_timeout: float | None = None) -> tuple[Any, StreamReader]:
    """aiohttp's client protocol, its parser past an answer's headers."""
    protocol = ResponseHandler(asyncio.get_running_loop())
    protocol.connection_made(Socket())  # type: ignore[arg-type]
    protocol.set_response_params(read_timeout=read_timeout)
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    protocol.data_received(head)
    reader = protocol._payload
    assert isinstance(reader, StreamReader)
    return protocol, reader


# Bytes, events, and bodies that read as HTTP chunks themselves (a tap that lost
# track of where aiohttp's parser is would take them for frames).
payload_lists = st.lists(
    st.binary(min_size=1, max_size=40)
    | st.sampled_from(["data: 你好 🚀\r\n\r\n".encode(), b"3\r\nabc\r\n", b"\r\n0\r\n\r\n"]),
    min_size=1,
    max_size=12,
)


@settings(max_examples=300)
@given(payloads=payload_lists, backlogs=st.lists(st.booleans(), min_size=1), data=st.data())
def test_the_tap_reads_an_answer_cut_anywhere_as_aiohttp_would(
    payloads: list[bytes], backlogs: list[bool], data: st.DataObject
) -> None:
    """Whatever the reads an answer comes in, and whichever chunks the client's
    backlog leaves to the task, every byte reaches the client once and in
    order, the answer ends, and the connection is aiohttp's again."""
    answer = framed_answer(payloads)
    # Cuts anywhere, and at a line's end or just after it (where a chunk or its
    # size line ends, or a size line has begun).
    ends = [i + 2 for i in range(len(answer)) if answer.startswith(b"\r\n", i)]
    lines = st.sampled_from(ends) | st.sampled_from(ends).map(lambda i: i + 1)
    cuts = data.draw(st.lists(st.integers(0, len(answer)) | lines))
    points = sorted({0, len(answer), *(min(c, len(answer)) for c in cuts)})
    reads = [answer[a:b] for a, b in zip(points, points[1:], strict=False)]
    got: list[bytes] = []  # by the tap or by the task, in the order the client gets them

    def relay(data: bytes) -> bytes:
        got.append(data)
        return data

    async def main() -> None:
        protocol, reader = await instance_answer()
        client = Transport()
        tap.attach_to(reader, Open(True), client, relay, lambda out: None, Upstream())  # type: ignore[arg-type]
        assert "data_received" in vars(protocol)
        waiting = await parked(reader)
        for i, data in enumerate(reads):
            client.backlog = tap.BACKLOG_BYTES + 1 if backlogs[i % len(backlogs)] else 0
            protocol.data_received(data)  # (as the event loop hands a read over)
            if waiting.done() and not reader.at_eof():  # the task's turn, then parked again
                got.append(waiting.result())
                waiting = await parked(reader)
        got.append(await asyncio.wait_for(waiting, 5))  # what was left, and the end
        assert reader.at_eof()
        assert "data_received" not in vars(protocol)  # aiohttp reads the connection again
        tap.detach(reader)

    asyncio.run(main())
    assert b"".join(got) == b"".join(payloads)


def test_a_size_line_cut_in_two_is_left_to_aiohttp() -> None:
    """A read that ends in a chunk's size line ("1" of "1a") leaves the parser
    inside it, though its last chunk ended: the rest ("a" and 26 bytes, of
    which the first 10 look like a whole chunk of their own) is aiohttp's."""
    payloads = [b"data: one\n\n", b"0123456789\r\n" + b"x" * 14, b"data: two\n\n"]
    answer = framed_answer(payloads)
    cut = answer.index(b"1a\r\n") + 1
    got: list[bytes] = []

    def relay(data: bytes) -> bytes:
        got.append(data)
        return data

    async def main() -> None:
        protocol, reader = await instance_answer()
        tap.attach_to(reader, Open(True), Transport(), relay, print, Upstream())  # type: ignore[arg-type]
        waiting = await parked(reader)
        for data in (answer[:cut], answer[cut:]):
            protocol.data_received(data)
        assert await asyncio.wait_for(waiting, 5) == b""

    asyncio.run(main())
    assert b"".join(got) == b"".join(payloads)


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_most_chunks_skip_aiohttps_parser(run: Any) -> None:
    """Against aiohttp's own server and sockets: chunks that come whole are read
    by the tap; aiohttp's protocol sees the first read (where its parser is is
    learnt from it) and the answer's end. On uvloop too, which keeps the
    protocol's `data_received` it calls (the tap has it look again)."""
    chunks = [f"data: {i} 你好 🚀\n\n".encode() for i in range(3000)]
    upstream = streaming(chunks, every=3, pause_s=0)

    async def main() -> None:
        runner, port = await serve(upstream)
        client = Transport()
        theirs: list[bytes] = []
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{port}/") as got,
            ):
                first = await got.content.readany()
                tap.attach_to(got.content, Open(False), client, bytes, lambda out: None, got)  # type: ignore[arg-type]
                frames = tap._TAPS[id(got.content)].frames
                assert frames is not None
                read = frames.theirs
                frames.theirs = lambda data: (theirs.append(data), read(data))[1]  # type: ignore[method-assign]
                rest = []
                while data := await got.content.readany():  # (no task of its own)
                    rest.append(data)
                tap.detach(got.content)
        finally:
            await runner.cleanup()
        assert first + b"".join(client.written) + b"".join(rest) == b"".join(chunks)
        assert len(theirs) <= 3 and theirs[-1].endswith(b"0\r\n\r\n")

    run(asyncio.wait_for(main(), 30))


def test_the_connections_read_timeout_holds_while_the_tap_reads() -> None:
    """aiohttp's `sock_read`: chunks that keep coming within it are no timeout,
    however long the answer; a silence past it is one."""

    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(8):  # 0.8 s in all, past the timeout, never 0.3 s apart
            await response.write(b"data: tick\n\n")
            await asyncio.sleep(0.1)
        await asyncio.sleep(5)  # then silent
        return response

    async def main() -> None:
        runner, port = await serve(upstream)
        client = Transport()
        timeout = aiohttp.ClientTimeout(sock_read=0.3)
        loop = asyncio.get_running_loop()
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(f"http://127.0.0.1:{port}/") as got,
            ):
                await got.content.readany()
                tap.attach_to(got.content, Open(False), client, bytes, lambda out: None, got)  # type: ignore[arg-type]
                assert tap._TAPS[id(got.content)].frames is not None
                with pytest.raises(aiohttp.ServerTimeoutError):
                    while await got.content.readany():
                        pass
                silent_s = loop.time() - last_write[0]
                tap.detach(got.content)
        finally:
            await runner.cleanup()
        assert len(client.written) == 7
        assert 0.29 <= silent_s < 0.9  # (uvloop's timers count whole milliseconds)

    last_write = [0.0]
    write = Transport.write

    def timed_write(self: Transport, data: bytes) -> None:
        last_write[0] = asyncio.get_running_loop().time()
        write(self, data)

    Transport.write = timed_write  # type: ignore[method-assign]
    try:
        asyncio.run(main())
    finally:
        Transport.write = write  # type: ignore[method-assign]


def test_what_the_relay_raises_ends_the_taps_reading() -> None:
    """A relay that raises amid a read of several chunks: the task reads the
    exception, nothing after it is relayed, and aiohttp reads the rest."""

    def relay(data: bytes) -> bytes:
        if data == b"two":
            raise ValueError("two")
        return data

    async def main() -> None:
        protocol, reader = await instance_answer()
        client = Transport()
        tap.attach_to(reader, Open(False), client, relay, print, Upstream())  # type: ignore[arg-type]
        waiting = await parked(reader)
        protocol.data_received(b"3\r\none\r\n")  # (the read aiohttp's parser is learnt from)
        protocol.data_received(b"3\r\none\r\n3\r\ntwo\r\n5\r\nthree\r\n")
        with pytest.raises(ValueError, match="two"):
            await waiting
        assert client.written == [b"one", b"one"]
        assert "data_received" not in vars(protocol)
        tap.detach(reader)

    asyncio.run(main())


@pytest.mark.parametrize(
    "headers", [{"Content-Encoding": "gzip"}, {"Transfer-Encoding": "gzip, chunked"}]
)
def test_an_answer_not_in_plain_chunks_is_read_by_aiohttp(headers: dict[str, str]) -> None:
    async def main() -> None:
        protocol, reader = await instance_answer()
        upstream = Upstream(**headers)
        tap.attach_to(reader, Open(False), Transport(), bytes, print, upstream)  # type: ignore[arg-type]
        assert tap._TAPS[id(reader)].frames is None
        assert "data_received" not in vars(protocol)
        tap.detach(reader)

    asyncio.run(main())


def test_a_paused_parser_resumed_goes_on_with_what_it_held() -> None:
    """A slow client leaves the chunks to the task; past the reader's high
    water aiohttp pauses its parser with the rest of a read in it, and resumes
    it with `data_received(b"")` once the task has drained the reader. The tap
    passes that on: the answer's end, held there, came only with a socket read
    that never came (the stream hung)."""
    big = b"x" * (600 * 1024)
    answer = tap.http_chunk(big) + tap.http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    async def main() -> bytes:
        protocol, reader = await instance_answer()
        client = Transport()
        client.backlog = tap.BACKLOG_BYTES + 1  # the tap declines: the task reads
        tap.attach_to(reader, Open(False), client, bytes, print, Upstream())  # type: ignore[arg-type]
        waiting = await parked(reader)
        protocol.data_received(answer)  # one socket read
        got = [await waiting]
        while data := await asyncio.wait_for(reader.readany(), 5):
            got.append(data)
        assert reader.at_eof() and "data_received" not in vars(protocol)
        tap.detach(reader)
        return b"".join(got)

    assert asyncio.run(main()) == big + b"data: [DONE]\n\n"


def test_a_reader_ended_leaves_its_connection_to_the_next_stream() -> None:
    """The body ended and its connection went back to the pool while the task
    still wrote to a slow client; another stream tapped the connection: the
    first task's detach leaves the second's reading alone."""

    async def main() -> None:
        protocol, first = await instance_answer()
        tap.attach_to(first, Open(False), Transport(), bytes, print, Upstream())  # type: ignore[arg-type]
        await parked(first)
        protocol.data_received(b"3\r\none\r\n0\r\n\r\n")  # (aiohttp's: learning, and the end)
        assert first.at_eof() and "data_received" not in vars(protocol)
        protocol.set_response_params()  # the pool hands the connection to the next call
        protocol.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        second = protocol._payload
        assert isinstance(second, StreamReader) and second is not first
        tap.attach_to(second, Open(False), Transport(), bytes, print, Upstream())  # type: ignore[arg-type]
        assert "data_received" in vars(protocol)
        tap.detach(first)
        assert "data_received" in vars(protocol)  # still the second stream's
        tap.detach(second)
        assert "data_received" not in vars(protocol)

    asyncio.run(main())
