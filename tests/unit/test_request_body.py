"""Request bodies inflated by Ferry itself, bounded (proxy/request_body.py `decode`)."""

from __future__ import annotations

import gzip
import random
import zlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.openai_request import BadRequest
from proxy.request_body import _WBITS, decode

GZIP, DEFLATE = _WBITS["gzip"], _WBITS["deflate"]
BODY = b'{"model": "m", "prompt": "\xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\x98\x80"}' * 50


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(
    "sent,wbits",
    [
        (gzip.compress(BODY), GZIP),
        (gzip.compress(BODY[:100]) + gzip.compress(BODY[100:]), GZIP),  # two members, as gzip reads
        (gzip.compress(BODY) + b"\0" * 16, GZIP),  # padded with zeros, as tar does
        (zlib.compress(BODY), DEFLATE),  # RFC 9110's deflate: zlib's wrapper
        (raw_deflate(BODY), DEFLATE),  # what some clients send as deflate
    ],
    ids=["gzip", "gzip-members", "gzip-padded", "deflate-zlib", "deflate-raw"],
)
def test_a_body_inflates_to_what_was_compressed(sent: bytes, wbits: int) -> None:
    assert decode(sent, wbits, len(BODY)) == BODY


def test_a_body_that_inflates_past_the_limit_is_413_without_inflating_on() -> None:
    bomb = gzip.compress(b" " * (64 << 20))  # 64 MB of spaces in 64 KB
    with pytest.raises(BadRequest) as refused:
        decode(bomb, GZIP, 1 << 20)
    assert refused.value.status == 413 and "inflates past" in refused.value.message
    assert decode(gzip.compress(b" " * 100), GZIP, 100) == b" " * 100  # the limit itself: taken


@pytest.mark.parametrize("wbits", [GZIP, DEFLATE])
def test_a_body_cut_short_is_400_not_a_shorter_body(wbits: int) -> None:
    """aiohttp took a truncated compressed body as the bytes it had inflated: a
    body cut in the middle went on as a shorter one."""
    sent = gzip.compress(BODY) if wbits == GZIP else zlib.compress(BODY)
    for cut in (1, len(sent) // 2, len(sent) - 1):
        with pytest.raises(BadRequest) as refused:
            decode(sent[:cut], wbits, 1 << 20)
        assert refused.value.status == 400, cut


@given(st.binary(max_size=300), st.integers(min_value=0, max_value=400), st.booleans())
def test_any_bytes_decode_whole_or_are_a_4xx(data: bytes, cut: int, as_gzip: bool) -> None:
    """Whatever a client sends, cut anywhere: the body it compressed, or a 400
    or 413 (never another exception, which would be a 500)."""
    wbits = GZIP if as_gzip else DEFLATE
    sent = (gzip.compress(data) if as_gzip else zlib.compress(data))[:cut]
    try:
        assert decode(sent, wbits, 1 << 20) == (data if sent else b"")  # (none: an empty body)
    except BadRequest as refused:
        assert refused.status in (400, 413)


@given(st.binary(max_size=200))
def test_garbage_is_a_400(garbage: bytes) -> None:
    for wbits in (GZIP, DEFLATE):
        try:
            decode(garbage, wbits, 1 << 20)
        except BadRequest as refused:
            assert refused.status in (400, 413)


def test_a_large_body_is_written_for_an_instance_off_the_event_loop() -> None:
    import asyncio
    import threading

    from proxy.openai_request import OFF_LOOP_BYTES
    from proxy.relay import _encoded

    seen: list[int] = []

    async def encode(size: int) -> bytes:
        import proxy.sse as sse

        dumps = sse.dumps
        try:
            sse.dumps = lambda body: (seen.append(threading.get_ident()), dumps(body))[1]  # type: ignore[assignment]
            return await _encoded({"a": 1}, size)
        finally:
            sse.dumps = dumps

    loop_thread = threading.get_ident()
    assert asyncio.run(encode(OFF_LOOP_BYTES)) == b'{"a":1}' and seen == [loop_thread]
    assert asyncio.run(encode(OFF_LOOP_BYTES + 1)) == b'{"a":1}' and seen[1] != loop_thread


def test_a_body_of_too_many_gzip_members_is_400() -> None:
    """Each member was inflated after a copy of the rest of the body: 4 MB of
    tiny members took 20 s of a worker thread (32 MiB, twenty minutes)."""
    from proxy.request_body import MAX_MEMBERS

    member = gzip.compress(b"x")
    assert decode(member * MAX_MEMBERS, GZIP, 1 << 20) == b"x" * MAX_MEMBERS
    with pytest.raises(BadRequest) as refused:
        decode(member * (MAX_MEMBERS + 1), GZIP, 1 << 20)
    assert refused.value.status == 400 and "gzip members" in refused.value.message


def test_a_body_inflated_past_its_time_is_408() -> None:
    import time

    with pytest.raises(BadRequest) as refused:
        decode(gzip.compress(BODY), GZIP, 1 << 20, deadline=time.monotonic() - 1)
    assert refused.value.status == 408


@pytest.mark.parametrize(
    "sent,wbits,said",
    [
        (gzip.compress(BODY) + b"\0\0junk", GZIP, "past its gzip stream"),
        (zlib.compress(BODY) + b"junk", DEFLATE, "past its deflate stream"),
    ],
    ids=["gzip", "deflate"],
)
def test_bytes_after_the_compressed_stream_are_400(sent: bytes, wbits: int, said: str) -> None:
    with pytest.raises(BadRequest) as refused:
        decode(sent, wbits, 1 << 20)
    assert refused.value.status == 400 and said in refused.value.message


def test_decode_tells_of_the_bytes_it_inflates_as_they_come() -> None:
    told: list[int] = []
    text = random.Random(0).randbytes(300_000)  # (its gzip is several slices)
    assert decode(gzip.compress(text), GZIP, 1 << 20, take=told.append) == text
    assert sum(told) == 300_000 and len(told) > 1


def test_bodies_being_inflated_hold_of_the_budget_what_they_inflated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two dozen clients each sending 30 KB of gzip (32 MB of spaces) made Ferry
    hold 3 GB: the budget counted the bytes sent only. Holding up front what a
    body may inflate to (a thousand times what came) made ordinary gzip
    traffic of 170 KB bodies fill the budget at 16 clients, and 503 the rest."""
    import asyncio
    import math
    import threading

    import proxy.request_body as request_body

    gate = threading.Event()

    def inflating(body: bytes, wbits: int, limit: int, deadline: float, take: Any) -> bytes:
        take(700_000)  # inflated so far
        gate.wait(5)
        return b"{}"

    monkeypatch.setattr(request_body, "decode", inflating)
    monkeypatch.setattr(request_body, "INFLATE_THREADS", 3)
    bodies = request_body.Bodies(1 << 20, 10.0, 2 << 20, 1)

    async def scenario() -> None:
        body = b"\x1f" * 2000
        held = [asyncio.create_task(bodies._inflated(body, GZIP, math.inf)) for _ in range(2)]
        await asyncio.sleep(0.1)
        assert (bodies.held, bodies.inflated) == (4000, 1_400_000)
        with pytest.raises(BadRequest) as busy:  # 700 KB more: past the 2 MiB
            await bodies._inflated(b"\x1f" * 10, GZIP, math.inf)
        assert busy.value.status == 503 and busy.value.headers == {"Retry-After": "1"}
        assert (bodies.held, bodies.inflated) == (4000, 1_400_000)  # (what it took, given back)
        held[0].cancel()  # its client hung up: the thread inflates on, and holds on
        await asyncio.sleep(0.1)
        assert (bodies.held, bodies.inflated) == (4000, 1_400_000)
        gate.set()
        assert await held[1] == b"{}"
        await asyncio.sleep(0.1)  # (the cancelled one's thread is done too)
        assert (bodies.held, bodies.inflated) == (0, 0)
        bodies.close()

    asyncio.run(scenario())


def test_bodies_inflating_leave_the_loops_own_threads_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flood of gzip bombs held every thread of the loop's default pool, where
    aiohttp resolves names and Ferry parses large bodies: a 100 KB request
    waited up to 1.6 s."""
    import asyncio
    import math
    import threading

    import proxy.request_body as request_body

    gate = threading.Event()
    monkeypatch.setattr(request_body, "decode", lambda *_: gate.wait(5) and b"{}")
    bodies = request_body.Bodies(1 << 20, 10.0, 1 << 30, 1)

    async def scenario() -> None:
        bombs = [asyncio.create_task(bodies._inflated(b"x", GZIP, math.inf)) for _ in range(40)]
        await asyncio.sleep(0.1)
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 2) == "free"
        gate.set()
        assert await asyncio.gather(*bombs) == [b"{}"] * 40
        bodies.close()

    asyncio.run(scenario())


def test_a_body_alone_inflates_to_the_limit_under_a_budget_short_of_twice_it() -> None:
    """Each inflated byte was counted twice (as it came, then for the join): a
    gzip body over half the budget was a 503 even alone, retried in vain,
    where the same body sent plain was taken."""
    import asyncio
    import math

    import proxy.request_body as request_body

    bodies = request_body.Bodies(1 << 20, 10.0, 3 << 19, 1)  # limit 1 MiB, budget 1.5 MiB
    text = b" " * 1_000_000

    async def inflated() -> bytes:
        try:
            return await bodies._inflated(gzip.compress(text), GZIP, math.inf)
        finally:
            bodies.close()

    assert asyncio.run(inflated()) == text
    assert (bodies.held, bodies.inflated) == (0, 0)
