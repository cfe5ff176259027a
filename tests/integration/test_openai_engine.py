"""`engine: openai`: Ferry in front of a server that is not vLLM (the stand-in in
tests/integration/openai_standin.py: no /metrics, no token ids, strict fields)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from proxy.openai_request import BYTES_PER_TOKEN
from tests.helpers import Ferry, Site, Sites, wait_until
from tests.integration.openai_standin import OpenAIStandIn

ADMIN = "sekret"


@pytest.fixture
def generic(sites: Sites) -> Callable[..., list[tuple[OpenAIStandIn, Site]]]:
    """Factory: start n generic OpenAI-compatible stand-ins on the loop thread."""
    return lambda n, **options: [
        sites.start(OpenAIStandIn(**options), handler_cancellation=True) for _ in range(n)
    ]


def front(ferry: Any, sites: list[Site], **sections: Any) -> Ferry:
    proxy: Ferry = ferry(
        [s.url for _, s in sites], instances_engine="openai", admin_token=ADMIN, **sections
    )
    return proxy


def client(proxy: Ferry) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)


def admin_instances(proxy: Ferry) -> list[dict[str, Any]]:
    request = urllib.request.Request(
        proxy.url + "/admin/instances", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        rows: list[dict[str, Any]] = json.loads(resp.read())
    return rows


def test_requests_succeed_streamed_and_whole(generic: Any, ferry: Any) -> None:
    [(standin, site)] = generic(1, itl_s=0.001)
    proxy = front(ferry, [(standin, site)])
    with client(proxy) as api:
        assert [m.id for m in api.models.list()] == ["generic"]
        chunks = api.completions.create(model="generic", prompt="hi", max_tokens=5, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == " tok" * 5
        whole = api.completions.create(model="generic", prompt="hi", max_tokens=3)
        assert whole.choices[0].text == " tok" * 3 and whole.usage is not None
        messages: Any = [{"role": "user", "content": "x"}]
        chat = api.chat.completions.create(model="generic", messages=messages, max_tokens=4)
        assert chat.choices[0].message.content == " tok" * 4
        stream = api.chat.completions.create(
            model="generic",
            messages=messages,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == " tok" * 6
        assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 6
    # Ferry sent the client's fields only: no `return_token_ids` (the stand-in
    # would have answered 400).
    assert len(standin.seen_bodies) == 4
    assert all("return_token_ids" not in body for body in standin.seen_bodies)
    [row] = admin_instances(proxy)
    assert (row["engine"], row["healthy"], row["snapshot"]) == ("openai", True, None)
    assert row["migration"] == "off"
    wait_until(lambda: proxy.view("i0").inflight == 0)


def test_the_ledger_estimates_tokens_from_the_text(generic: Any, ferry: Any) -> None:
    [(standin, site)] = generic(1, itl_s=0.05)
    proxy = front(ferry, [(standin, site)])
    stream = client(proxy).completions.create(
        model="generic", prompt="x" * 40, max_tokens=200, stream=True
    )
    chunks = iter(stream)
    for _ in range(20):
        next(chunks)

    def entry() -> Any:
        [only] = proxy.loop.call(lambda: list(proxy.cluster.ledger.entries("i0")))
        return only

    # The prompt is Ferry's estimate at dispatch (no ids to correct it); each " tok"
    # (4 characters) counts one generated token, so the request's blocks grow.
    assert entry().prompt_tokens == 40 // BYTES_PER_TOKEN and not entry().prompt_exact
    assert entry().generated_tokens >= 20
    wait_until(lambda: entry().generated_tokens >= 40)
    ledger = proxy.cluster.ledger
    assert (
        proxy.loop.call(ledger.blocks, "i0") >= 4
    )  # ceil((13 + 40) / 16): vLLM's block size, used where none is known
    view = proxy.view("i0")
    # No engine metrics: capacity is unknown, so freeness is -(requests in flight).
    assert (view.capacity_blocks, view.batch, view.freeness, view.dispatchable) == (0, 1, -1, True)
    stream.close()
    wait_until(lambda: proxy.view("i0").inflight == 0)


def test_two_stand_ins_share_load_by_requests_in_flight(generic: Any, ferry: Any) -> None:
    sites = generic(2, itl_s=0.05)
    proxy = front(ferry, sites)
    api = client(proxy)

    def hold() -> tuple[Any, str]:
        stream = api.completions.create(model="generic", prompt="x", max_tokens=400, stream=True)
        next(iter(stream))  # open: the request stays in flight
        return stream, stream.response.headers["x-ferry-instance"]

    held = [hold() for _ in range(4)]
    assert sorted(name for _, name in held) == ["i0", "i0", "i1", "i1"]
    # Free one side: new requests go there until the counts are level again.
    for stream, name in held:
        if name == "i0":
            stream.close()
    wait_until(lambda: proxy.view("i0").inflight == 0)
    more = [hold() for _ in range(2)]
    assert [name for _, name in more] == ["i0", "i0"]
    assert [standin.running for standin, _ in sites] == [2, 2]
    for stream, _ in held + more:
        stream.close()
    wait_until(lambda: proxy.view("i0").inflight + proxy.view("i1").inflight == 0)


def test_health_follows_v1_models(generic: Any, ferry: Any) -> None:
    [(standin, site)] = generic(1, itl_s=0.001)
    proxy = front(ferry, [(standin, site)], scheduler={"unhealthy_after_failures": 3})
    assert proxy.view("i0").healthy
    standin.models_status = 503
    wait_until(lambda: not proxy.view("i0").healthy)
    [row] = admin_instances(proxy)
    assert not row["healthy"] and "GET /v1/models returned HTTP 503" in row["last_error"]
    with client(proxy) as api, pytest.raises(openai.APIStatusError) as failed:
        api.completions.create(model="generic", prompt="x", max_tokens=2)
    assert failed.value.status_code in (404, 503)  # no healthy instance serves the model
    standin.models_status = 200
    wait_until(lambda: proxy.view("i0").healthy)
    with client(proxy) as api:
        assert api.completions.create(model="generic", prompt="x", max_tokens=2).choices


@pytest.mark.parametrize("framing", ["crlf", "cr", "nospace"])
def test_streams_framed_as_other_servers_frame_them_are_relayed_and_counted(
    generic: Any, ferry: Any, framing: str
) -> None:
    """SSE lets a server end lines with CRLF (sse-starlette does: llama-cpp-python
    and others) and drop the space after `data:`. Such a stream reaches the
    client whole, ends cleanly, and its tokens are counted as it goes."""
    [(standin, site)] = generic(1, itl_s=0.02)
    standin.framing = framing
    proxy = front(ferry, [(standin, site)])
    with client(proxy) as api:
        stream = api.completions.create(model="generic", prompt="hi", max_tokens=40, stream=True)
        chunks = iter(stream)
        text = "".join(next(chunks).choices[0].text for _ in range(20))
        [entry] = proxy.loop.call(lambda: list(proxy.cluster.ledger.entries("i0")))
        assert entry.generated_tokens >= 19  # counted as it came, not at the end
        text += "".join(c.choices[0].text for c in chunks)
        assert text == " tok" * 40
        messages: Any = [{"role": "user", "content": "x"}]
        chat = api.chat.completions.create(
            model="generic",
            messages=messages,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts = list(chat)
        assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == " tok" * 5
        assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 5
    text_ = urllib.request.urlopen(proxy.url + "/metrics", timeout=5).read().decode()
    assert 'ferry_requests_total{instance="i0",outcome="ok"} 2.0' in text_


def test_a_server_that_answers_a_stream_request_whole_is_passed_on_whole(
    generic: Any, ferry: Any
) -> None:
    [(standin, site)] = generic(1, itl_s=0.001)
    standin.ignore_stream = True
    proxy = front(ferry, [(standin, site)])
    answer = httpx.post(
        proxy.url + "/v1/completions",
        json={"model": "generic", "prompt": "hi", "max_tokens": 3, "stream": True},
    )
    assert answer.status_code == 200
    assert answer.headers["Content-Type"].startswith("application/json")
    assert answer.json()["choices"][0]["text"] == " tok" * 3


@pytest.mark.parametrize("done", [True, False], ids=["done", "finish-only"])
def test_a_finished_stream_its_server_leaves_open_ends_at_once(
    generic: Any, ferry: Any, done: bool
) -> None:
    """A server that keeps a finished stream's body open (its [DONE] sent, or
    every choice's finish) held the client, and billed the instance, until the
    idle timeout: now the stream ends a moment after its last event, counted ok
    (also where the client, having its [DONE], hung up first)."""
    [(standin, site)] = generic(1, itl_s=0.01)
    standin.send_done, standin.hold_open_s = done, 30.0
    proxy = front(ferry, [(standin, site)], server={"upstream_idle_timeout_s": 20.0})
    started = time.monotonic()
    with client(proxy) as api:
        stream = api.completions.create(model="generic", prompt="x", max_tokens=5, stream=True)
        assert "".join(c.choices[0].text for c in stream) == " tok" * 5
        wait_until(lambda: admin_instances(proxy)[0]["inflight"] == 0, timeout=10)
    assert time.monotonic() - started < 5  # the grace of a second, not the 20 s
    ok = 'ferry_requests_total{instance="i0",outcome="ok"} 1.0'
    wait_until(lambda: ok in urllib.request.urlopen(proxy.url + "/metrics").read().decode())


def test_a_server_error_answered_with_a_200_is_tried_elsewhere(generic: Any, ferry: Any) -> None:
    """`{"error": {... "code": 500}}` with status 200 is a failed answer, as the
    same error opening a stream is: the other instance answers; where none
    can, the client gets a 502 in OpenAI's shape, not a 200 without choices."""
    (bad, bad_site), (good, good_site) = generic(2)
    bad.error_with_200 = True
    proxy = front(ferry, [(bad, bad_site), (good, good_site)], scheduler={"policy": "round_robin"})
    with client(proxy) as api:
        for _ in range(4):
            answer = api.completions.create(model="generic", prompt="x", max_tokens=2)
            assert answer.choices[0].text == " tok" * 2
        assert bad.served >= 1
        good.error_with_200 = True
        with pytest.raises(openai.InternalServerError) as failed:
            api.completions.create(model="generic", prompt="x", max_tokens=2)
        assert failed.value.status_code == 502
        assert "stand-in engine failed" in failed.value.message
