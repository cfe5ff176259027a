from __future__ import annotations

import pytest

from proxy import token_ids
from proxy.openai_request import BadRequest, parse
from proxy.policy import Priority


def test_parses_completions_and_chat() -> None:
    req = parse(b'{"model": "m", "prompt": "abcdefghi"}', "completions", None)
    assert (req.model, req.prompt_estimate, req.priority) == ("m", 3, Priority.NORMAL)
    req = parse(b'{"model": "m", "prompt": [1, 2, 3, 4]}', "completions", "high")
    assert (req.prompt_estimate, req.priority) == (4, Priority.HIGH)
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "abcdef"}]}'
    assert parse(chat, "chat", "LOW").priority == Priority.LOW


@pytest.mark.parametrize(
    ("raw", "endpoint", "header", "message"),
    [
        (b"", "completions", None, "empty"),
        (b"{nope", "completions", None, "not valid JSON"),
        (b"[1]", "completions", None, "JSON object"),
        (b'{"prompt": "x"}', "completions", None, "'model' is required"),
        (b'{"model": 3, "prompt": "x"}', "completions", None, "'model' is required"),
        (b'{"model": "m"}', "completions", None, "'prompt' is required"),
        (b'{"model": "m"}', "chat", None, "'messages' is required"),
        (b'{"model": "m", "prompt": "x", "stream": "yes"}', "completions", None, "'stream'"),
        (b'{"model": "m", "prompt": "x"}', "completions", "urgent", "x-ferry-priority"),
    ],
)
def test_bad_requests_are_explained(
    raw: bytes, endpoint: str, header: str | None, message: str
) -> None:
    with pytest.raises(BadRequest, match=message):
        parse(raw, endpoint, header)


def test_token_ids_are_counted_and_hidden() -> None:
    # Shapes captured from vLLM 0.32 with return_token_ids.
    completion = (
        b'{"id":"cmpl-1","choices":[{"index":0,"text":"e","prompt_token_ids":[45,74,81],'
        b'"token_ids":[74]}]}'
    )
    assert token_ids.scan(completion) == (3, 1, True)
    assert token_ids.hide(completion) == (
        b'{"id":"cmpl-1","choices":[{"index":0,"text":"e","prompt_token_ids":null,'
        b'"token_ids":null}]}'
    )
    chat_first = (
        b'{"choices":[{"delta":{"role":"assistant","content":""}}],"prompt_token_ids":[3,4]}'
    )
    assert token_ids.scan(chat_first) == (2, 0, True)
    # Text that merely mentions the key is escaped inside JSON and never matches.
    tricky = b'{"choices":[{"text":"\\"token_ids\\":[1,2]","token_ids":[]}]}'
    assert token_ids.scan(tricky) == (None, 0, True)
    assert token_ids.scan(b'{"choices":[{"text":"hi","token_ids":null}]}') == (None, 0, False)
