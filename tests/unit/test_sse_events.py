"""An upstream stream's bytes cut into whole events, however they were read."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.sse import AnswerTooLarge, Events, KeepAliveWatch, KeptAliveOnly

EVENTS = [b'data: {"a":1}', b"data: \xe4\xbb\x8a\xf0\x9f\x9a\x80", b": comment", b"data: [DONE]"]


@given(
    framing=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    cuts=st.lists(st.integers(0, 200), max_size=12),
)
def test_any_cut_of_a_stream_gives_the_same_events(framing: bytes, cuts: list[int]) -> None:
    """Reads cut anywhere (inside a CRLF, a blank line, a UTF-8 character)
    give the events, whole, in order, with LF line ends, whichever of SSE's
    three line ends the server sends (a lone CR was read as no line end)."""
    stream = b"".join(e.replace(b"\n", framing) + framing * 2 for e in EVENTS)
    events = Events(limit=1 << 20)
    out = b""
    at = 0
    for cut in sorted({min(c, len(stream)) for c in cuts} | {len(stream)}):
        out += events.take(stream[at:cut]) if cut > at else b""
        at = cut
    assert out.split(b"\n\n")[:-1] == EVENTS and out.endswith(b"\n\n")


@pytest.mark.parametrize("framing", [b"\n", b"\r\n", b"\r"])
def test_a_stream_read_a_byte_at_a_time_gives_the_same_events(framing: bytes) -> None:
    """(A blank line whose bytes came in three reads was missed.)"""
    stream = b"".join(e.replace(b"\n", framing) + framing * 2 for e in EVENTS)
    events = Events(limit=1 << 20)
    out = b"".join(events.take(stream[i : i + 1]) for i in range(len(stream)))
    assert out.split(b"\n\n")[:-1] == EVENTS and out.endswith(b"\n\n")


def test_line_ends_mixed_in_one_stream_are_each_one_line_end() -> None:
    """A CR, then an LF in the next read, is one CRLF: no blank line between them."""
    events = Events(limit=1 << 20)
    assert events.take(b"data: a\r") == b""
    assert events.take(b"\ndata: b\r") == b""  # the LF ends the CR's line: not a blank one
    assert events.take(b"\r\ndata: c\r") == b"data: a\ndata: b\n\n"
    assert events.take(b"\n") == b""  # the CRLF's second half
    assert events.take(b"\n") == b"data: c\n\n"


def test_one_event_past_the_limit_gives_the_stream_up() -> None:
    """An event that never ends (a broken or hostile engine) is not held without bound."""
    events = Events(limit=1000)
    assert events.take(b"data: " + b"x" * 500) == b""
    with pytest.raises(AnswerTooLarge):
        events.take(b"x" * 600)
    # Many events, each under the limit, are no matter.
    events = Events(limit=1000)
    for _ in range(100):
        assert events.take(b"data: " + b"y" * 900 + b"\n\n")


def test_an_event_read_in_many_pieces_is_joined_once() -> None:
    """Pieces are kept as they came, not copied into one buffer per read (the
    quadratic cost of a long event)."""
    events = Events(limit=1 << 30)
    piece = b"z" * 1024
    events.take(b"data: ")
    for _ in range(1000):
        assert events.take(piece) == b""
    assert len(events._parts) == 1001  # joined only when the event ends
    whole = events.take(b"\n\n")
    assert whole == b"data: " + piece * 1000 + b"\n\n" and not events._parts


@pytest.mark.parametrize("ping", [b": ping\n\n", b"\n\n", b"\r\n\r\n", b"\n", b""])
def test_pings_or_blank_lines_alone_are_no_progress(ping: bytes) -> None:
    """An upstream that sends nothing but comments or blank lines, or reads that
    end no event (b""), is as hung as a silent one, once `idle_s` passes; one
    event with data is progress."""
    now = [0.0]
    watch = KeepAliveWatch(2.0, lambda: now[0])
    now[0] = 1.0
    watch.saw(b'\ndata: {"a":1}\n\n')  # a blank line before an event: progress
    for t in (2.0, 2.9):
        now[0] = t
        watch.saw(ping)
    now[0] = 3.1
    with pytest.raises(KeptAliveOnly):
        watch.saw(ping)


def test_a_byte_order_mark_before_the_first_event_is_dropped() -> None:
    """SSE drops it; kept, it hid the first event from Ferry (its token ids went
    to a client that never asked for them, its prompt count to no ledger)."""
    events = Events(1 << 20)
    assert events.take(b"\xef\xbb\xbfdata: {}\n\n") == b"data: {}\n\n"
    assert events.take(b"\xef\xbb\xbfdata: {}\n\n") == b"\xef\xbb\xbfdata: {}\n\n"  # later: data
