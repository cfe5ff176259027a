"""What Ferry makes of an instance's error body (proxy/relay.py `_message_of`)."""

from __future__ import annotations

from proxy.relay import _message_of


def test_an_error_body_is_read_for_its_message_or_shown_as_text() -> None:
    assert _message_of(b'{"error":{"message":"full"}}') == "full"
    assert _message_of(b"not json \xff") == "not json \ufffd"
    assert _message_of(b"[" * 100_000) == "[" * 200  # nested too deep to parse: no 500
