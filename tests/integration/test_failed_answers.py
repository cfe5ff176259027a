"""Answers that are an instance's failure though they do not look like one: a
stream that opens with the error event of a dead engine, a 204, a 401 to the
key Ferry sent, a 200 whose JSON is broken, a redirect. Each is tried on
another instance (nothing has reached the client yet) and held against the
instance; where none is left, the client gets a 502 in the OpenAI shape.
Stand-in servers (loadtest/standin_server.py), not vLLM; migration off, so
that the streams take the path of a stream that cannot move, unless a test
turns it on."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from proxy.config import parse_config
from tests.helpers import Ferry, wait_until
from tests.integration.test_api_surface import assert_openai_error

BODY = {"model": "standin", "prompt": "x", "max_tokens": 3}


def metrics(proxy: Ferry) -> str:
    return httpx.get(proxy.url + "/metrics").text


@pytest.mark.parametrize("fault", ["error_after", "abort_after"])
def test_a_stream_that_opens_with_a_server_error_is_tried_elsewhere(
    standins: Any, ferry: Any, fault: str
) -> None:
    """vLLM answers every stream of a dead engine with a 200 and a 500 error
    event: such a stream went to the client as it came, half the streams of a
    round robin failed, and the instance was never ejected."""
    (dead, bad), (_, good) = standins(2, itl_s=0.001)
    setattr(dead, fault, 0)
    proxy = ferry([bad.url, good.url], scheduler={"policy": "round_robin"})
    api = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=10)
    for _ in range(4):
        chunks = api.completions.create(**BODY, stream=True)  # type: ignore[call-overload]
        assert "".join(c.choices[0].text for c in chunks) == " tok" * 3
    page = metrics(proxy)
    assert 'ferry_requests_total{instance="i1",outcome="ok"} 4.0' in page
    assert 'ferry_retries_total{reason="error_event"}' in page
    assert 'instance="i0",outcome="ok"' not in page
    alone = ferry([bad.url])
    answer = httpx.post(alone.url + "/v1/completions", json={**BODY, "stream": True}, timeout=10)
    assert_openai_error(answer, 502, "upstream_error")
    assert "answered with an error" in answer.json()["error"]["message"]
    wait_until(lambda: alone.view("i0").inflight == 0 and proxy.view("i0").inflight == 0)


def test_a_server_error_mid_stream_counts_against_its_instance(standins: Any, ferry: Any) -> None:
    """Once bytes have gone out the engine's error event goes on as it came (the
    client sees it), and the call is a broken stream, not an `ok`."""
    [(dying, site)] = standins(1, itl_s=0.001)
    dying.error_after = 2
    proxy = ferry([site.url])
    with httpx.stream("POST", proxy.url + "/v1/completions", json={**BODY, "stream": True}) as got:
        assert got.status_code == 200
        text = got.read().decode()
    assert text.count(" tok") == 2 and '"error"' in text and text.endswith("data: [DONE]\n\n")
    assert 'ferry_requests_total{instance="i0",outcome="stream_broken"} 1.0' in metrics(proxy)


def test_a_request_engines_give_up_mid_stream_ejects_no_instance(standins: Any, ferry: Any) -> None:
    """vLLM gives up some requests mid-stream with a server error event and
    serves the rest (its own bug with `n`, `echo` and `logprobs` together): such
    a stream, one that cannot move, was held against its instance, and a client
    repeating it ejected healthy instances. A body given up before is the
    request's doing (the next test: other requests given up so still count)."""
    (first, a), (second, b) = standins(2, itl_s=0.001)
    first.error_after = second.error_after = 2
    proxy = ferry([a.url, b.url], scheduler={"policy": "round_robin"})
    for _ in range(12):  # past eject_after_failures (5) on each
        answer = httpx.post(proxy.url + "/v1/completions", json={**BODY, "stream": True})
        assert answer.text.count(" tok") == 2 and '"error"' in answer.text
    page = metrics(proxy)
    assert 'ferry_requests_total{instance="i0",outcome="stream_broken"} 6.0' in page
    assert 'ferry_ejections_total{instance="i0"} 0.0' in page
    assert not proxy.view("i0").ejected and not proxy.view("i1").ejected


def test_an_instance_that_gives_up_every_stream_mid_way_is_ejected(
    standins: Any, ferry: Any
) -> None:
    (sick, a), (_, b) = standins(2, itl_s=0.001)
    sick.error_after = 2
    proxy = ferry([a.url, b.url], scheduler={"policy": "round_robin"})
    broken = 0
    for n in range(40):  # each its own request
        body = {**BODY, "prompt": f"x{n}", "stream": True}
        broken += '"error"' in httpx.post(proxy.url + "/v1/completions", json=body).text
    # Ejected after eject_after_failures (5) for 5 s, doubling: 5, more on a slow machine.
    assert 5 <= broken < 10
    assert 'ferry_ejections_total{instance="i0"} 0.0' not in metrics(proxy)


def test_a_request_an_error_event_refuses_is_the_clients_answer(standins: Any, ferry: Any) -> None:
    """An error event with a 4xx code is the request's fault: it goes to the
    client, and no other instance is tried."""
    (first, a), (second, b) = standins(2, itl_s=0.001)
    events = b'data: {"error": {"message": "bad lora", "code": 400}}\n\ndata: [DONE]\n\n'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n"
    for standin in (first, second):
        standin.raw_answer = [head % len(events) + events]
    proxy = ferry([a.url, b.url])
    answer = httpx.post(proxy.url + "/v1/completions", json={**BODY, "stream": True}, timeout=10)
    assert answer.status_code == 200 and "bad lora" in answer.text
    assert len(first.seen_bodies) + len(second.seen_bodies) == 1
    assert "ferry_retries_total{" not in metrics(proxy)


@pytest.mark.parametrize("status", [204, 307])
@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_that_is_no_answer_is_tried_elsewhere(
    standins: Any, ferry: Any, status: int, stream: bool
) -> None:
    (broken, bad), (_, good) = standins(2, itl_s=0.001)
    broken.fail_status = status
    proxy = ferry([bad.url, good.url], scheduler={"policy": "round_robin"})
    for _ in range(4):
        answer = httpx.post(proxy.url + "/v1/completions", json={**BODY, "stream": stream})
        assert answer.status_code == 200 and answer.headers["x-ferry-instance"] == "i1"
    alone = ferry([bad.url])
    answer = httpx.post(alone.url + "/v1/completions", json={**BODY, "stream": stream})
    assert_openai_error(answer, 502, "upstream_error")


def test_a_200_whose_json_is_broken_is_tried_elsewhere(standins: Any, ferry: Any) -> None:
    """Braces at both ends are not JSON: a cut or garbled answer went on as a 200."""
    (broken, bad), (_, good) = standins(2, itl_s=0.001)
    broken.whole_body = b'{"choices": [ }'
    proxy = ferry([bad.url, good.url], scheduler={"policy": "round_robin"})
    for _ in range(4):
        answer = httpx.post(proxy.url + "/v1/completions", json=BODY)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " tok" * 3


def keyed(urls: list[str], **instance: Any) -> Any:
    raw = {
        "instances": [{"name": f"i{n}", "url": u, **instance} for n, u in enumerate(urls)],
        "scheduler": {"scrape_interval_s": 0.05, "seed": 1, "policy": "round_robin"},
    }
    return parse_config(raw, env={})


def test_a_401_to_ferrys_key_is_the_instances_failure(standins: Any, loop_thread: Any) -> None:
    """An instance configured with the wrong `api_key` answered half the
    requests with its 401, and the client read it as its own key refused."""
    (refusing, bad), (_, good) = standins(2, itl_s=0.001)
    refusing.fail_status = 401
    proxy = Ferry(loop_thread, keyed([bad.url, good.url], api_key="stale"))
    alone = Ferry(loop_thread, keyed([bad.url], api_key="stale"))
    try:
        api = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=10)
        for _ in range(4):
            assert api.completions.create(**BODY).choices[0].text == " tok" * 3
        failed = 'ferry_requests_total{instance="i0",outcome="upstream_error"} '
        assert failed in metrics(proxy) and failed + "0.0" not in metrics(proxy)
        answer = httpx.post(
            alone.url + "/v1/completions", json=BODY, headers={"Authorization": "x"}
        )
        assert_openai_error(answer, 502, "upstream_error")
        assert "refused Ferry's credentials (HTTP 401)" in answer.json()["error"]["message"]
    finally:
        proxy.close()
        alone.close()


def test_a_401_to_the_clients_own_key_is_the_clients_answer(standins: Any, ferry: Any) -> None:
    """Without a key of its own for the instance, Ferry sends the client's on:
    then the 401 is the client's."""
    (refusing, a), (_, b) = standins(2, itl_s=0.001)
    refusing.fail_status = 401
    proxy = ferry([a.url, b.url], scheduler={"policy": "round_robin"})
    api = openai.OpenAI(base_url=proxy.url + "/v1", api_key="mine", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        for _ in range(2):  # one of two goes to the refusing instance first
            api.completions.create(**BODY)
    # With no key from the client either, still: a client sending none must
    # not get instances ejected.
    for _ in range(6):
        assert httpx.post(proxy.url + "/v1/completions", json=BODY).status_code in (200, 401)
    assert "ferry_retries_total{" not in metrics(proxy)
    assert not proxy.view("i0").ejected


def test_a_compressed_4xx_goes_on_as_it_came(standins: Any, ferry: Any) -> None:
    """Bytes compressed though Ferry asked for none are not JSON to Ferry: the
    error went out as gzip bytes in a message, its encoding dropped."""
    import gzip

    [(standin, site)] = standins(1, itl_s=0.001)
    body = gzip.compress(b'{"error": {"message": "too long for the context", "code": 400}}')
    standin.raw_answer = [
        b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
        b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    ]
    proxy = ferry([site.url])
    answer = httpx.post(proxy.url + "/v1/completions", json=BODY)
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "too long for the context"


def test_a_4xx_that_is_not_json_comes_in_the_openai_shape(standins: Any, ferry: Any) -> None:
    [(standin, site)] = standins(1, itl_s=0.001)
    standin.raw_answer = [
        b"HTTP/1.1 413 Too Large\r\nContent-Type: text/html\r\nContent-Length: 21\r\n\r\n"
        b"<h1>413 too big</h1>\n"
    ]
    proxy = ferry([site.url])
    answer = httpx.post(proxy.url + "/v1/completions", json=BODY)
    assert_openai_error(answer, 413, "upstream_error")
    assert "<h1>413 too big</h1>" in answer.json()["error"]["message"]


def test_a_request_every_instance_gives_up_ejects_none(standins: Any, ferry: Any) -> None:
    """With migration on, a stream an engine gives up (a server error event)
    fails over, and the instance it left was held to it at once: a request
    that makes every engine fail (vLLM sends a 500 error event for some bodies)
    charged each instance it went through, so a client repeating it ejected
    instances. It is held against none where every instance gave it up, and
    against the one that gave it up where another served it."""
    (first, a), (second, b) = standins(2, itl_s=0.001)
    first.error_after = second.error_after = 0
    proxy = ferry([a.url, b.url], instances_migration="lite", scheduler={"policy": "round_robin"})
    for _ in range(6):  # past eject_after_failures (5)
        answer = httpx.post(proxy.url + "/v1/completions", json={**BODY, "stream": True})
        assert answer.status_code == 502 and '"error"' in answer.text  # before any byte
    assert 'ferry_ejections_total{instance="i0"} 0.0' in metrics(proxy)
    assert not proxy.view("i0").ejected and not proxy.view("i1").ejected
    second.error_after = None  # now i0 is a dead engine beside a live one
    api = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=10)
    for _ in range(10):
        chunks = api.completions.create(**BODY, stream=True)  # type: ignore[call-overload]
        assert "".join(c.choices[0].text for c in chunks) == " tok" * 3
    wait_until(lambda: proxy.view("i0").ejected)
    assert not proxy.view("i1").ejected
