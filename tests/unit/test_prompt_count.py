"""Reading a prompt's count off vLLM's `/tokenize` answer (proxy/relay.py)."""

from __future__ import annotations

import pytest

from proxy.relay import _count_in


@pytest.mark.parametrize(
    ("answer", "count"),
    [
        (b'{"count":3,"max_model_len":4096,"tokens":[1,2,3],"token_strs":null}', 3),
        (b'{ "count" : 12345 }', 12345),
        (b'{"max_model_len":4096,"count":3}', None),  # not vLLM's order: the estimate places it
        (b'{"count":-1}', None),
        (b'{"error": {"message": "no"}}', None),
        (b"", None),
    ],
)
def test_a_tokenize_answer_is_read_for_its_count_alone(answer: bytes, count: int | None) -> None:
    """vLLM's answer lists every token id after its count: a megabyte for a long
    prompt, which parsed whole would hold the event loop."""
    assert _count_in(answer) == count
