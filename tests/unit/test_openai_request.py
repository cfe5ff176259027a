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
    chunk = {"choices": [{"text": "", "token_ids": [5], "prompt_token_ids": [1, 2, 3]}]}
    assert token_ids.count(chunk) == (3, 1)
    token_ids.hide(chunk)
    assert chunk == {"choices": [{"text": "", "token_ids": None, "prompt_token_ids": None}]}
    chat_first = {"prompt_token_ids": [1, 2], "choices": [{"delta": {"role": "assistant"}}]}
    assert token_ids.count(chat_first) == (2, 0)
    token_ids.hide(chat_first)
    assert chat_first["prompt_token_ids"] is None
    body, wants = token_ids.upstream_body({"model": "m"})
    assert body["return_token_ids"] is True and not wants
    assert token_ids.upstream_body({"return_token_ids": True})[1]
