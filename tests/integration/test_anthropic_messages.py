"""Anthropic's Messages API (`/v1/messages`), as vLLM serves it, through Ferry
with the official `anthropic` client. Stand-in servers (not vLLM) that answer the
route in outline, as vLLM 0.32's `vllm/entrypoints/anthropic` does.

vLLM answers its own errors there in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`) and ends a Messages stream it
fails with an `event: error`; the `anthropic` client raises on that, and skips
an event with no name."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.integration.test_shutdown import serving

ASK = {"model": "standin", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


def client(url: str, key: str | None = None) -> anthropic.Anthropic:
    """The official client; `key` is sent as `Authorization: Bearer`, as vLLM and
    Ferry take a key (its `api_key` goes as `x-api-key`)."""
    credential = {"auth_token": key} if key else {"api_key": "x"}
    return anthropic.Anthropic(base_url=url, max_retries=0, timeout=10, **credential)


def anthropic_error(answer: httpx.Response, status: int, kind: str) -> str:
    """The message of an error in Anthropic's shape, checked."""
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    return str(body["error"]["message"])


def test_a_messages_call_goes_through_whole_and_streamed(standins: Any, ferry: Any) -> None:
    [(_, site)] = standins(1, itl_s=0.001)
    api = client(ferry([site.url]).url)
    whole = api.messages.create(**ASK)
    assert whole.content[0].text == " tok" * 5  # type: ignore[union-attr]
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 5
    with api.messages.stream(**ASK) as stream:
        assert stream.get_final_text() == " tok" * 5


def test_a_broken_messages_stream_raises_in_the_anthropic_client(standins: Any, ferry: Any) -> None:
    """Ferry ended a Messages stream whose instance broke with an unnamed error
    event, which the client skips: it read the cut answer as a whole one."""
    [(standin, site)] = standins(1, itl_s=0.001)
    standin.break_after = 3
    proxy = ferry([site.url])
    seen: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as raised:
        for event in client(proxy.url).messages.create(**ASK, stream=True):
            seen.append(event.type)
    assert seen.count("content_block_delta") == 3 and "message_stop" not in seen
    assert raised.value.body["type"] == "error"  # type: ignore[index]
    assert "broke the stream" in raised.value.body["error"]["message"]  # type: ignore[index]
    with httpx.stream("POST", proxy.url + "/v1/messages", json={**ASK, "stream": True}) as got:
        text = got.read().decode()
    assert text.endswith("event: error\ndata: " + text.rsplit("data: ", 1)[1])
    assert "[DONE]" not in text  # (a Messages stream has none)


def test_ferrys_own_errors_on_messages_are_in_anthropics_shape(standins: Any, ferry: Any) -> None:
    [(standin, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url], api_keys=["k"], admin_token="a", server={"max_body_bytes": 4096})
    url, key = proxy.url + "/v1/messages", {"Authorization": "Bearer k"}
    message = anthropic_error(
        httpx.post(url, json={**ASK, "model": "nope"}, headers=key), 404, "not_found_error"
    )
    assert "nope" in message
    anthropic_error(httpx.post(url, json=ASK), 401, "authentication_error")
    anthropic_error(httpx.post(url + "/count_tokens", json=ASK), 401, "authentication_error")
    big = {**ASK, "system": "x" * 5000}
    anthropic_error(httpx.post(url, json=big, headers=key), 413, "request_too_large")
    broken = {**key, "Content-Type": "application/json"}
    anthropic_error(httpx.post(url, content=b"{", headers=broken), 400, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as raised:
        client(proxy.url, "k").messages.create(**{**ASK, "model": "nope"})
    assert raised.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    # An instance's own answer goes on as it came (vLLM's validation errors on
    # this route are in OpenAI's shape).
    standin.fail_status = 400
    answer = httpx.post(url, json=ASK, headers=key)
    assert (
        answer.status_code == 400 and "stand-in told to fail" in answer.json()["error"]["message"]
    )
    standin.fail_status = None
    drain = httpx.post(
        proxy.url + "/admin/instances/i0/drain", headers={"Authorization": "Bearer a"}
    )
    assert drain.status_code == 200, drain.text
    anthropic_error(httpx.post(url, json=ASK, headers=key, timeout=10), 503, "overloaded_error")
    # Elsewhere the OpenAI shape stays.
    answer = httpx.post(
        proxy.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, headers=key
    )
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"


def test_an_empty_model_on_a_passed_through_call_names_none(standins: Any, ferry: Any) -> None:
    """vLLM answers `"model": ""` with its first model (on /tokenize, Responses,
    embeddings), as Ferry's own routes read it; a passed-through call was a 404."""
    [(_, site)] = standins(1)
    proxy = ferry([site.url])
    for path, body in [
        ("/tokenize", {"model": "", "prompt": "hi"}),
        ("/v1/responses", {"model": "", "input": "hi", "max_output_tokens": 2}),
    ]:
        answer = httpx.post(proxy.url + path, json=body, timeout=10)
        assert answer.headers.get("x-ferry-instance") == "i0", (path, answer.text)


def test_a_messages_stream_is_counted_as_one_that_cannot_move(standins: Any, ferry: Any) -> None:
    """A drain waits for it (it is not OpenAI's chunks): the count says why."""
    [(_, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url], instances_migration="lite")
    with client(proxy.url).messages.stream(**ASK) as stream:
        assert stream.get_final_text() == " tok" * 5
    page = httpx.get(proxy.url + "/metrics").text
    assert 'ferry_non_migratable_requests_total{reason="passed through"} 1.0' in page


def test_a_whole_messages_call_cut_by_a_shutdown_is_answered_in_anthropics_shape(
    standins: Any, tmp_path: Path
) -> None:
    """`ferry serve` as a process: a call sent nothing yet when the shutdown's
    grace ends gets a 503, here in Anthropic's shape (it was OpenAI's)."""
    [(_, site)] = standins(1, itl_s=0.05)  # 400 tokens: 20 s before its answer
    server = {"shutdown_delay_s": 0.2, "shutdown_grace_s": 1.0}
    config = {"instances": [{"name": "a", "url": site.url}], "server": server}
    with serving(config, tmp_path / "ferry.yaml") as (proc, url):
        threading.Timer(0.5, proc.send_signal, (signal.SIGTERM,)).start()
        answer = httpx.post(url + "/v1/messages", json={**ASK, "max_tokens": 400}, timeout=30)
        message = anthropic_error(answer, 503, "overloaded_error")
        assert "shut down" in message and answer.headers["Retry-After"] == "1"
        assert proc.wait(10) == 0
