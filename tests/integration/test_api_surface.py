"""The rest of the API surface (pass-through routes) against two stand-in servers
(loadtest/standin_server.py, not vLLM) serving different models: each route
family goes to the instance serving the body's `model`, a stream arrives as a
stream, whole answers and upstream errors arrive as the instance gave them."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
import urllib.request
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import Ferry, wait_until

# vLLM's model-routed routes that the stand-in answers in outline, with a body each takes.
ROUTES: dict[str, dict[str, Any]] = {
    "/tokenize": {"prompt": "a b"},
    "/detokenize": {"tokens": [7, 7]},
    "/pooling": {"input": "x"},
    "/classify": {"input": "x"},
    "/score": {"text_1": "q", "text_2": "d"},
    "/v1/score": {"text_1": "q", "text_2": "d"},
    "/rerank": {"query": "q", "documents": ["d"]},
    "/v1/rerank": {"query": "q", "documents": ["d"]},
    "/v2/rerank": {"query": "q", "documents": ["d"]},
    "/v2/embed": {"texts": ["x"]},
}


def client(proxy: Ferry) -> openai.OpenAI:
    # A timeout: a stream that Ferry buffered would otherwise hang the test.
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=10)


@pytest.fixture
def two_models(standins: Any, ferry: Any) -> Ferry:
    """Ferry in front of i0 serving "alpha" and i1 serving "beta"."""
    (_, alpha), (_, beta) = standins(1, model="alpha")[0], standins(1, model="beta")[0]
    proxy: Ferry = ferry([alpha.url, beta.url])
    return proxy


def assert_openai_error(response: httpx.Response, status: int, code: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_engine_routes_go_by_model(two_models: Ferry, path: str) -> None:
    for model, instance in (("alpha", "i0"), ("beta", "i1")):
        answer = httpx.post(two_models.url + path, json={"model": model, **ROUTES[path]})
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-ferry-instance"] == instance
        if path not in ("/tokenize", "/detokenize"):
            assert answer.json()["model"] == model and answer.json()["route"] == path
    # Named no model, the engine answers with its first: here that would be a draw.
    nameless = httpx.post(two_models.url + path, json=ROUTES[path])
    assert_openai_error(nameless, 400, None)
    assert "'model' is required" in nameless.json()["error"]["message"]
    unknown = httpx.post(two_models.url + path, json={"model": "nope", **ROUTES[path]})
    assert_openai_error(unknown, 404, "model_not_found")
    assert unknown.json()["error"]["param"] == "model"


def test_a_call_that_names_no_model_goes_to_the_model_every_instance_serves_first(
    standins: Any, ferry: Any
) -> None:
    (alpha, a), (beta, b) = standins(1, model="alpha")[0], standins(1, model="alpha")[0]
    proxy = ferry([a.url, b.url])
    for path in ("/v1/embeddings", "/tokenize"):
        body = {"input": "x"} if path == "/v1/embeddings" else {"prompt": "a b"}
        assert httpx.post(proxy.url + path, json=body).status_code == 200
    assert alpha.answers or beta.answers


def test_tokenize_and_detokenize_answer_as_the_instance_does(two_models: Ferry) -> None:
    tokens = httpx.post(two_models.url + "/tokenize", json={"model": "beta", "prompt": "a b c"})
    assert tokens.json()["tokens"] == [7, 7, 7]
    text = httpx.post(two_models.url + "/detokenize", json={"model": "beta", "tokens": [7, 7]})
    assert text.json() == {"prompt": " tok tok"}


def test_embeddings_and_responses_go_by_model(two_models: Ferry) -> None:
    with client(two_models) as api:
        for model, instance in (("alpha", "i0"), ("beta", "i1")):
            raw = api.embeddings.with_raw_response.create(model=model, input="x")
            assert raw.headers["x-ferry-instance"] == instance
            assert raw.parse().model == model
            answer = api.responses.with_raw_response.create(
                model=model, input="hi", max_output_tokens=3
            )
            assert answer.headers["x-ferry-instance"] == instance
            assert answer.parse().model == model
            assert answer.parse().output_text == " tok" * 3
        with pytest.raises(openai.NotFoundError, match="not served here"):
            api.embeddings.create(model="nope", input="x")
        with pytest.raises(openai.NotFoundError, match="not served here"):
            api.responses.create(model="nope", input="x")


def test_a_streamed_response_arrives_as_it_is_made(
    standins: Any, ferry: Any, loop_thread: Any
) -> None:
    [(standin, site)] = standins(1, itl_s=0.001)
    gate = asyncio.Event()  # the stand-in holds the rest of its stream until this is set
    standin.responses_gate = gate
    proxy = ferry([site.url])
    with client(proxy) as api:
        stream = api.responses.create(model="standin", input="hi", max_output_tokens=4, stream=True)
        events = iter(stream)
        try:
            assert next(events).type == "response.created"
            first = next(events)
            # The stand-in has not finished (it waits for the gate): this came on its own.
            assert first.type == "response.output_text.delta" and first.delta == " tok"
            assert not gate.is_set()
            assert proxy.view("i0").inflight == 1  # billed for as long as it streams
        finally:
            loop_thread.call(gate.set)
        rest = list(events)
    deltas = [e.delta for e in rest if e.type == "response.output_text.delta"]
    assert deltas == [" tok"] * 3
    assert rest[-1].type == "response.completed"
    assert rest[-1].response.output_text == " tok" * 4
    wait_until(lambda: proxy.view("i0").inflight == 0)


def test_a_passed_through_stream_compressed_against_the_ask_keeps_its_encoding(
    standins: Any, ferry: Any
) -> None:
    """A passed-through stream (a Responses one) goes on byte for byte: one an
    instance gzipped though asked for identity reached the client as gzip
    labelled plain text, unreadable. Its Content-Encoding goes with it."""
    [(standin, site)] = standins(1, itl_s=0.001)
    standin.gzip_stream = True
    proxy = ferry([site.url])
    with client(proxy) as api:
        events = list(
            api.responses.create(model="standin", input="x", max_output_tokens=3, stream=True)
        )
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == [" tok"] * 3
    assert events[-1].type == "response.completed"
    wait_until(lambda: proxy.view("i0").inflight == 0)


def test_a_passed_through_stream_that_breaks_ends_with_an_error_event(
    standins: Any, ferry: Any
) -> None:
    [(standin, site)] = standins(1, itl_s=0.001)
    standin.break_after = 2
    proxy = ferry([site.url])
    body = {"model": "standin", "input": "x", "max_output_tokens": 5, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/responses", json=body) as answer:
        assert answer.status_code == 200
        events = [e for e in answer.read().decode().split("\n\n") if e]
    assert [e.split("\n")[0] for e in events[:3]] == [
        "event: response.created",
        "event: response.output_text.delta",
        "event: response.output_text.delta",
    ]
    error = json.loads(events[-1].removeprefix("data: "))["error"]  # no [DONE] in Responses
    assert "broke the stream" in error["message"] and error["type"] == "upstream_error"
    wait_until(lambda: proxy.view("i0").inflight == 0)


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_its_instance_ends_early_ends_with_an_error_event(
    standins: Any, ferry: Any, chat: bool
) -> None:
    """An instance that closes a stream cleanly before its end (no finish reason,
    no [DONE]) cut it short: a stream that cannot move says so to its client, and
    the access log and the instance's failures count it, as a broken one."""
    [(standin, site)] = standins(1, itl_s=0.001)
    standin.end_after = 2
    proxy = ferry([site.url])
    if chat:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}]}
        path = "/v1/chat/completions"
    else:
        body, path = {"prompt": "x"}, "/v1/completions"
    body |= {"model": "standin", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", proxy.url + path, json=body) as answer:
        assert answer.status_code == 200
        events = [e for e in answer.read().decode().split("\n\n") if e]
    assert len(events) == 4 and all(e.startswith("data: {") for e in events[:-1])
    assert events[-1] == "data: [DONE]"  # after the error event, as vLLM ends one
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "ended before its [DONE]" in error["message"] and error["type"] == "upstream_error"
    assert error["code"] == "upstream_error"  # (it was null; vLLM's own carry one)
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'ferry_requests_total{instance="i0",outcome="stream_broken"} 1.0' in metrics
    wait_until(lambda: proxy.view("i0").inflight == 0)


@pytest.mark.parametrize("end", ["broken", "silent"])
def test_a_stream_whose_instance_fails_after_its_finish_still_ends_with_done(
    standins: Any, ferry: Any, end: str
) -> None:
    """An instance that dies after a stream's last token, before its [DONE] (or
    goes silent, its socket open): the client has the whole stream, and is sent
    the [DONE] (it was not: a client that waits for one waited), as a movable
    stream's is."""
    [(standin, site)] = standins(1, itl_s=0.001)
    if end == "broken":
        standin.break_after = 4  # its connection dropped after the 4th, last, token
    else:
        standin.send_done, standin.hold_open_s = False, 2.0  # past the body-end grace
    proxy = ferry([site.url])
    body = {"model": "standin", "prompt": "x", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body) as answer:
        events = [e for e in answer.read().decode().split("\n\n") if e]
    assert len(events) == 5 and events[-1] == "data: [DONE]", events
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"]
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'ferry_requests_total{instance="i0",outcome="ok"} 1.0' in metrics


def test_a_finished_stream_without_done_is_whole(standins: Any, ferry: Any) -> None:
    """Some OpenAI-compatible servers end a stream after its finish reason without
    [DONE]: that stream is whole, not cut short."""
    [(standin, site)] = standins(1, itl_s=0.001)
    standin.send_done = False
    proxy = ferry([site.url])
    api = client(proxy)
    chunks = api.completions.create(model="standin", prompt="x", max_tokens=4, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == " tok" * 4
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'ferry_requests_total{instance="i0",outcome="ok"} 1.0' in metrics


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_a_client_that_reads_nothing_is_let_go(standins: Any, ferry: Any, migration: str) -> None:
    """A client that keeps its socket open but stops reading would hold its
    request, and the instance's memory, for ever: after its send timeout the
    request ends, upstream too, as a client gone."""
    [(standin, site)] = standins(1, itl_s=0.0)
    proxy = ferry([site.url], instances_migration=migration, server={"client_send_timeout_s": 0.5})
    body = json.dumps({"model": "standin", "prompt": "x", "max_tokens": 100_000, "stream": True})
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", int(proxy.url.rsplit(":", 1)[1])))
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: ferry\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        wait_until(lambda: standin.running == 1)
        wait_until(lambda: standin.running == 0 and proxy.view("i0").inflight == 0, timeout=30)
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'ferry_requests_total{instance="i0",outcome="client_disconnect"} 1.0' in metrics


def test_whole_answers_pass_through_byte_for_byte(standins: Any, ferry: Any) -> None:
    [(_, site)] = standins(1)
    proxy = ferry([site.url])
    body = {"model": "standin", "input": ["x", "y"]}
    direct = httpx.post(site.url + "/v1/embeddings", json=body)
    relayed = httpx.post(proxy.url + "/v1/embeddings", json=body)
    assert relayed.status_code == 200 and relayed.content == direct.content
    assert relayed.headers["content-length"] == str(len(direct.content))  # whole, not chunked
    assert relayed.headers["content-type"] == direct.headers["content-type"]
    with client(proxy) as api:
        assert api.embeddings.create(model="standin", input="x").data[0].embedding == [0.0, 1.0]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/responses", "/rerank", "/tokenize"])
def test_upstream_4xx_passes_through_untouched(standins: Any, ferry: Any, path: str) -> None:
    [(standin, site)] = standins(1)
    proxy = ferry([site.url])
    standin.fail_status = 422
    body = {"model": "standin", "prompt": "x", "input": "x"}
    direct = httpx.post(site.url + path, json=body)
    relayed = httpx.post(proxy.url + path, json=body)
    assert relayed.status_code == 422 and relayed.content == direct.content
    assert relayed.headers["content-type"] == direct.headers["content-type"]


def test_the_openai_client_sees_an_upstream_4xx(standins: Any, ferry: Any) -> None:
    [(standin, site)] = standins(1)
    proxy = ferry([site.url])
    standin.fail_status = 400
    with client(proxy) as api, pytest.raises(openai.BadRequestError, match="told to fail"):
        api.responses.create(model="standin", input="x", stream=True)


def test_a_body_ferry_cannot_route_by_is_a_400_in_the_openai_shape(two_models: Ferry) -> None:
    url = two_models.url
    assert_openai_error(httpx.post(url + "/v1/responses", json={"model": 5}), 400, None)
    assert_openai_error(httpx.post(url + "/rerank", json=["alpha"]), 400, None)
    bad = httpx.post(url + "/pooling", content=b"{", headers={"Content-Type": "application/json"})
    assert_openai_error(bad, 400, None)
    # A body Ferry does not read (not JSON) names no model it can see: here,
    # where the instances serve different ones, it goes nowhere at random.
    form = httpx.post(url + "/v1/embeddings", content=b"model=alpha")
    assert_openai_error(form, 400, None)
    assert "'model' is required" in form.json()["error"]["message"]


def test_a_body_ferry_does_not_read_goes_on_as_it_came(standins: Any, ferry: Any) -> None:
    [(_, site)] = standins(1)
    proxy = ferry([site.url])
    form = httpx.post(proxy.url + "/v1/embeddings", content=b"model=standin")
    assert form.status_code == 400 and "Unsupported Media Type" in form.text  # the engine's


def test_instances_are_asked_for_uncompressed_answers(standins: Any, ferry: Any) -> None:
    """Ferry reads and relays instances' bodies as they come, never decompressing
    them: it asks for none, whatever the client accepts."""
    [(standin, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url])
    body = {"model": "standin", "prompt": "x", "max_tokens": 2, "stream": True}
    answer = httpx.post(
        proxy.url + "/v1/completions", json=body, headers={"Accept-Encoding": "gzip, br"}
    )
    assert answer.status_code == 200 and "[DONE]" in answer.text
    sent = {k.lower(): v for k, v in standin.seen_headers[-1].items()}
    assert sent["accept-encoding"] == "identity"


def test_an_echo_is_sent_without_asking_for_token_ids(standins: Any, ferry: Any) -> None:
    """vLLM 0.32 drops a completion's echoed prompt when asked for token ids."""
    [(standin, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url])
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model="standin", prompt="x", max_tokens=2, echo=True)
    assert "return_token_ids" not in standin.seen_bodies[-1]
    client.completions.create(model="standin", prompt="x", max_tokens=2)
    assert standin.seen_bodies[-1]["return_token_ids"] is True


def test_a_null_stream_is_no_stream(standins: Any, ferry: Any) -> None:
    """The OpenAI spec lets `stream` be null, and vLLM takes it."""
    [(_, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url])
    body = {"model": "standin", "prompt": "x", "max_tokens": 2, "stream": None}
    answer = httpx.post(proxy.url + "/v1/completions", json=body)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " tok" * 2
    answer = httpx.post(proxy.url + "/v1/completions", json={**body, "stream": "maybe"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stream"


@pytest.mark.parametrize("case", ["n=2", "usage"])
def test_a_stream_cut_after_some_of_its_ends_ends_with_an_error_event(
    standins: Any, ferry: Any, case: str
) -> None:
    """A finish reason ends one choice, not the stream: an instance that dies
    after choice 1 finished but before choice 0 did, or after the last token but
    before the usage chunk the client asked for, cut the stream short (it ended
    cleanly, as if whole, and the rest was lost without a word)."""
    [(standin, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url])
    body: dict[str, Any] = {"model": "standin", "prompt": "x", "max_tokens": 4, "stream": True}
    if case == "n=2":
        body["n"] = 2
        standin.break_after = 3  # choice 1 (3 tokens) has finished, choice 0 has not
    else:
        body["stream_options"] = {"include_usage": True}
        standin.break_after = 4  # every token sent, then dead before the usage chunk
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body) as answer:
        events = [e for e in answer.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    finishes = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-2]]
    assert finishes.count("length") == 1  # choice 1's, or the only choice's
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "broke the stream" in error["message"] and error["type"] == "upstream_error"
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'ferry_requests_total{instance="i0",outcome="stream_broken"} 1.0' in metrics


def test_a_stream_of_several_choices_is_whole_when_each_has_finished(
    standins: Any, ferry: Any
) -> None:
    """n > 1 from a server that sends no [DONE]: whole once every choice finished."""
    [(standin, site)] = standins(1, itl_s=0.001)
    standin.send_done = False
    proxy = ferry([site.url])
    chunks = client(proxy).completions.create(
        model="standin", prompt="x", n=2, max_tokens=4, stream=True
    )
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: " tok" * 4, 1: " tok" * 3}
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'ferry_requests_total{instance="i0",outcome="ok"} 1.0' in metrics


def test_a_clients_headers_go_on_but_hop_by_hop_and_ferrys_own(standins: Any, ferry: Any) -> None:
    """vLLM reads headers of its own (X-Vllm-Priority, X-Session-ID,
    X-data-parallel-rank): they reach it as the client sent them (they were
    dropped). Hop-by-hop headers, those a Connection header names, the body's
    and Ferry's own do not."""
    [(standin, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url])
    body = {"model": "standin", "prompt": "x", "max_tokens": 2}
    sent_headers = {
        "X-Vllm-Priority": "-5",
        "X-Session-ID": "s1",
        "X-data-parallel-rank": "1",
        "X-Custom": "kept",
        "Connection": "keep-alive, X-Hop",
        "X-Hop": "dropped",
        "x-ferry-priority": "high",
        "Keep-Alive": "timeout=5",
        "Accept-Encoding": "gzip",
    }
    answer = httpx.post(proxy.url + "/v1/completions/", json=body, headers=sent_headers)
    assert answer.status_code == 200, answer.text
    seen = {k.lower(): v for k, v in standin.seen_headers[-1].items()}
    for name in ("x-vllm-priority", "x-session-id", "x-data-parallel-rank", "x-custom"):
        assert seen[name] == sent_headers[next(k for k in sent_headers if k.lower() == name)]
    for name in ("x-hop", "x-ferry-priority", "keep-alive"):
        assert name not in seen, name
    assert seen["accept-encoding"] == "identity" and seen["content-type"] == "application/json"


@pytest.mark.parametrize(
    "path",
    ["/v1/completions/", "/v1/chat/completions/", "/v1/chat%2Fcompletions"],
)
def test_a_trailing_slash_or_an_escape_is_the_same_endpoint(
    standins: Any, ferry: Any, path: str
) -> None:
    """`/v1/completions/` went on as it came, to an engine that redirects it to
    itself (followed past the proxy, unparsed and unbilled): it is the endpoint.
    So is `/v1/chat%2Fcompletions`, which the engine unescapes and serves as a
    chat: it was passed through unseen by the ledger and the priorities."""
    [(standin, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url])
    body: dict[str, Any] = {"model": "standin", "max_tokens": 3, "stream": True}
    body |= {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    answer = httpx.post(proxy.url + path, json=body)
    assert answer.status_code == 200 and "[DONE]" in answer.text
    assert standin.seen_bodies[-1]["return_token_ids"] is True  # parsed as the endpoint
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'ferry_generation_tokens_total{instance="i0",model="standin"} 3.0' in metrics
    bad = httpx.post(proxy.url + path, json={"model": "standin"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_one_model_is_retrieved_as_openais_sdk_asks(standins: Any, ferry: Any) -> None:
    [(_, site)] = standins(1, itl_s=0.001)
    api = client(ferry([site.url]))
    assert api.models.retrieve("standin").id == "standin"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        api.models.retrieve("nope")
    assert [m.id for m in api.models.list()] == ["standin"]


def test_a_multipart_upload_goes_to_an_instance_serving_its_model(
    standins: Any, ferry: Any
) -> None:
    """An audio upload (multipart form) names its model in a form field: it goes
    to an instance serving that model (it went to any), file and all."""
    (alpha, alpha_site), (beta, beta_site) = (
        standins(1, model="alpha")[0],
        standins(1, model="beta")[0],
    )
    proxy = ferry([alpha_site.url, beta_site.url], scheduler={"policy": "round_robin"})
    api = client(proxy)
    for _ in range(4):
        heard = api.audio.transcriptions.create(model="beta", file=("a.wav", b"RIFF" * 1000))
        assert heard.text == "beta heard 4000 bytes for beta"
    assert (alpha.served, beta.served) == (0, 4)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        api.audio.transcriptions.create(model="gamma", file=("a.wav", b"RIFF"))


def test_a_cookie_an_instance_sets_is_not_sent_with_other_clients_calls(
    standins: Any, ferry: Any
) -> None:
    """Ferry's client session kept the cookies instances set and sent them on
    with every later call, whoever made it."""
    [(standin, site)] = standins(1, itl_s=0.001)
    standin.cookie = "alice"
    # By a name: aiohttp's jar keeps no cookie an IP address sets.
    proxy = ferry([site.url.replace("127.0.0.1", "localhost")])
    body = {"model": "standin", "prompt": "x", "max_tokens": 1}
    first = httpx.post(proxy.url + "/v1/completions", json=body)
    assert first.status_code == 200
    second = httpx.post(proxy.url + "/v1/completions", json=body)
    assert second.status_code == 200
    assert "cookie" not in {k.lower() for k in standin.seen_headers[-1]}


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_an_instances_rate_limits_and_retry_hints_reach_the_client_and_no_more(
    standins: Any, ferry: Any, migration: str
) -> None:
    """A gateway's rate limits and retry hints and an engine's own `x-` headers go
    on, on whole answers, streams (moving or not), errors and pass-throughs;
    those of one hop, the body's framing, and what would speak for Ferry's own
    origin (vLLM's CORS headers allow every origin by default; cookies) do not."""
    [(standin, site)] = standins(1, itl_s=0.001)
    standin.extra_headers = {
        "Access-Control-Allow-Origin": "*",
        "Set-Cookie": "gateway=secret",
        "Strict-Transport-Security": "max-age=1",
        "x-ratelimit-remaining-requests": "7",
        "retry-after-ms": "250",
        "Connection": "x-hop",
        "x-hop": "this hop only",
        "Server": "uvicorn",
    }
    proxy = ferry([site.url], instances_migration=migration)
    body = {"model": "standin", "prompt": "x", "max_tokens": 3}
    answers = [
        httpx.post(proxy.url + "/v1/completions", json=body),
        httpx.post(proxy.url + "/v1/completions", json={**body, "stream": True}),
        httpx.post(proxy.url + "/tokenize", json={"model": "standin", "prompt": "x"}),
    ]
    standin.fail_status = 429  # an engine's (or its gateway's) refusal
    answers.append(httpx.post(proxy.url + "/v1/completions", json=body))
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    for answer in answers:
        headers = answer.headers
        assert headers["x-ratelimit-remaining-requests"] == "7", headers
        assert headers["retry-after-ms"] == "250"
        assert headers["x-ferry-instance"] == "i0"
        dropped = ("access-control-allow-origin", "set-cookie", "strict-transport-security")
        assert not set(dropped) & set(headers), headers
        assert "x-hop" not in headers and headers.get("server", "") != "uvicorn"
    assert answers[1].headers["content-type"] == "text/event-stream; charset=utf-8"  # as vLLM
    assert b"data: [DONE]" in answers[1].content


@pytest.mark.parametrize("method", ["GET", "HEAD", "PUT"])
def test_a_405_of_the_engine_says_which_methods_its_route_takes(
    standins: Any, ferry: Any, method: str
) -> None:
    """HTTP asks a 405 for its Allow header (RFC 9110 15.5.6): the engine's was
    dropped with the headers Ferry does not relay. Its answer is not JSON, so
    Ferry says it in OpenAI's shape, with the headers a JSON one would have."""
    [(_, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url])
    for path in ("/v1/completions", "/v1/chat/completions/", "/v1/embeddings"):
        answer = httpx.request(method, proxy.url + path)
        assert answer.status_code == 405 and answer.headers.get("allow") == "POST", answer.headers
        assert answer.headers["x-ferry-instance"] == "i0"


def test_sagemaker_invocations_are_read_as_the_request_their_body_is(
    standins: Any, ferry: Any
) -> None:
    """`/invocations` (SageMaker's one route, which vLLM serves) is a chat where
    the body has `messages`, a completion where it has `prompt`: placed, counted
    and streamed as those are; anything else passes through as it came."""
    [(standin, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url], instances_migration="lite")
    chat = {"model": "standin", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    streamed = httpx.post(proxy.url + "/invocations", json={**chat, "stream": True})
    events = [json.loads(e[6:]) for e in streamed.text.split("\n\n") if e.startswith("data: {")]
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == " tok" * 3
    assert standin.seen_bodies[-1]["return_token_ids"] is True  # Ferry's own: it can move
    assert all(e["choices"][0].get("token_ids") is None for e in events)  # ... and hid them
    whole = httpx.post(proxy.url + "/invocations", json={"model": "standin", "prompt": "x"})
    assert whole.status_code == 200 and whole.json()["object"] == "text_completion"
    other = {"model": "standin", "input": "x"}
    httpx.post(proxy.url + "/invocations", json=other)
    assert standin.seen_bodies[-1] == other  # passed through, as it came
    assert [path for path, _ in standin.answers] == ["/invocations"] * 3


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_an_http_1_0_stream_ends_with_its_connection(
    standins: Any, ferry: Any, migration: str
) -> None:
    """HTTP/1.0 has no chunks: the body ends where the connection does. Kept
    alive, the client waited out the idle timeout for the end of its stream."""
    [(_, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url], instances_migration=migration)
    body = json.dumps({"model": "standin", "prompt": "x", "max_tokens": 3, "stream": True})
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.0\r\nConnection: keep-alive\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        received = b""
        while chunk := conn.recv(65536):  # times out (5 s) if the connection stays open
            received += chunk
    head, _, answer = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower()
    assert answer.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("stream", [False, True])
def test_a_redirect_from_an_instance_is_not_followed(
    standins: Any, ferry: Any, stream: bool
) -> None:
    """An instance that redirects (a misconfigured URL, a trailing slash) is
    not followed past the proxy, nor passed on as a redirect to nowhere."""
    [(standin, site)] = standins(1, itl_s=0.001)
    standin.fail_status = 307
    proxy = ferry([site.url])
    body = {"model": "standin", "prompt": "x", "max_tokens": 1, "stream": stream}
    answer = httpx.post(proxy.url + "/v1/completions", json=body)
    assert answer.status_code == 502, answer.text
    assert "a redirect" in answer.json()["error"]["message"]


def test_idle_and_slow_clients_are_let_go(standins: Any, ferry: Any) -> None:
    """A connection idle after its request, or whose headers never end, is
    closed after client_keepalive_s (aiohttp keeps one an hour: idle sockets
    used up the file descriptors), and a body that never ends gets 408 after
    client_body_timeout_s."""
    [(_, site)] = standins(1, itl_s=0.001)
    server = {"client_keepalive_s": 0.5, "client_body_timeout_s": 0.5}
    proxy = ferry([site.url], server=server)
    port = int(proxy.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as idle:
        idle.sendall(b"GET /livez HTTP/1.1\r\nHost: ferry\r\n\r\n")
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)
        assert idle.recv(4096) == b""  # closed by Ferry
    with socket.create_connection(("127.0.0.1", port), timeout=5) as headers_never_end:
        headers_never_end.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: fer")
        assert headers_never_end.recv(4096) == b""  # closed within client_keepalive_s
    with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: ferry\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        started = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = slow.recv(4096)
            if not chunk:
                break
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"request body not received within 0.5 s" in answer
        assert time.monotonic() - started < 3


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_answers_past_max_answer_bytes_are_given_up(
    standins: Any, ferry: Any, migration: str
) -> None:
    """An instance's whole answer, or one stream event, past max_answer_bytes is
    a 502 (or an error event), not gigabytes in Ferry's memory; a /metrics page
    past 16 MiB fails its scrape."""
    [(standin, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url], instances_migration=migration, server={"max_answer_bytes": 1 << 20})
    body = {"model": "standin", "prompt": "x", "max_tokens": 3}
    standin.pad_whole_bytes = 1 << 21
    whole = httpx.post(proxy.url + "/v1/completions", json=body)
    assert whole.status_code == 502 and "over 1048576" in whole.json()["error"]["message"]
    standin.pad_whole_bytes = 1 << 19  # under the cap: whole
    assert len(httpx.post(proxy.url + "/v1/completions", json=body).content) > 1 << 19
    standin.endless_after = 2
    with httpx.stream("POST", proxy.url + "/v1/completions", json={**body, "stream": True}) as s:
        events = [e for e in s.read().split(b"\n\n") if e]
    assert len(events) == 4  # two tokens, the error the endless event became, [DONE]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert "broke" in error["message"] and error["type"] == "upstream_error"
    standin.endless_after = None
    labels = 'engine="0",model_name="standin"'
    standin.metrics_body = (
        f"vllm:num_requests_running{{{labels}}} 0.0\n" + "# pad\n" * (3 << 22)
    ).encode()
    wait_until(lambda: not proxy.view("i0").healthy, timeout=10)


@pytest.mark.parametrize("named", [None, ""])
def test_a_body_naming_no_model_gets_the_model_every_instance_serves(
    standins: Any, ferry: Any, named: str | None
) -> None:
    """vLLM serves its own model to a request that names none: where every
    instance serves the same models, Ferry names that one and places the request."""
    pairs = standins(2)
    proxy = ferry([site.url for _, site in pairs])
    body: dict[str, Any] = {"prompt": "x", "max_tokens": 2}
    if named is not None:
        body["model"] = named
    for stream in (False, True):
        answer = httpx.post(proxy.url + "/v1/completions", json={**body, "stream": stream})
        assert answer.status_code == 200, answer.text
        served = pairs[int(answer.headers["x-ferry-instance"][1:])][0]
        assert served.seen_bodies[-1]["model"] == "standin"
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert httpx.post(proxy.url + "/v1/chat/completions", json=chat).status_code == 200


def test_a_body_naming_no_model_is_a_400_where_instances_serve_different_ones(
    two_models: Ferry,
) -> None:
    answer = httpx.post(two_models.url + "/v1/completions", json={"prompt": "x"})
    assert_openai_error(answer, 400, None)
    error = answer.json()["error"]
    assert error["param"] == "model" and "'alpha', 'beta'" in error["message"]


def test_vllms_ping_and_version(standins: Any, ferry: Any) -> None:
    """vLLM's `/ping` (SageMaker's health check) is Ferry's readiness; its
    `/version` is an instance's."""
    [(_, site)] = standins(1)
    proxy = ferry([site.url])
    assert httpx.get(proxy.url + "/ping").status_code == 200
    assert httpx.post(proxy.url + "/ping").status_code == 200
    version = httpx.get(proxy.url + "/version")
    assert version.status_code == 200 and version.json() == {"version": "standin-standin"}


def test_a_header_as_long_as_a_large_jwt_is_taken(standins: Any, ferry: Any) -> None:
    """aiohttp's default refuses a header line past 8 KiB; vLLM's server takes it."""
    [(standin, site)] = standins(1)
    proxy = ferry([site.url])
    token = "x" * 20_000
    body = {"model": "standin", "prompt": "x", "max_tokens": 1}
    answer = httpx.post(proxy.url + "/v1/completions", json=body, headers={"X-Big": token})
    assert answer.status_code == 200, answer.text
    assert standin.seen_headers[-1]["X-Big"] == token


def test_a_whole_200_that_is_no_answer_is_tried_elsewhere(standins: Any, ferry: Any) -> None:
    """A 200 whose body is not a JSON object (a gateway's page in front of a
    broken instance) answers nothing: the request goes to another instance,
    and where none is left the client gets a 502, not the page as a 200."""
    (broken, bad_site), (_, good_site) = standins(2)
    broken.whole_body = b"<html>upstream maintenance</html>"
    proxy = ferry([bad_site.url, good_site.url], scheduler={"policy": "round_robin"})
    body = {"model": "standin", "prompt": "x", "max_tokens": 2}
    for _ in range(4):  # each instance gets first try
        answer = httpx.post(proxy.url + "/v1/completions", json=body)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " tok tok"
        assert answer.headers["x-ferry-instance"] == "i1"
    alone = ferry([bad_site.url])
    assert_openai_error(httpx.post(alone.url + "/v1/completions", json=body), 502, "upstream_error")


def test_a_body_naming_no_model_gets_the_base_model_beside_aliases_and_adapters(
    standins: Any, ferry: Any
) -> None:
    """vLLM serves its first model name to a body that names none: an alias
    listed after it or a LoRA adapter (a card with a `parent`) on one instance
    does not make the instances differ."""
    (lora, site_a), (_, site_b) = standins(2)
    cards = [
        {"id": "standin", "object": "model", "max_model_len": 4096},
        {"id": "my-lora", "object": "model", "parent": "standin"},
    ]
    lora.models_body = json.dumps({"object": "list", "data": cards}).encode()
    proxy = ferry([site_a.url, site_b.url])
    for _ in range(2):
        answer = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(
    "path",
    [
        "/v1/../metrics",
        "/v1/%2e%2e/metrics",
        "/v1/..%2Fmetrics",
        "/v1/./../metrics",
        "/v1/%252e%252e/metrics",
        "/v1/.%252E/metrics",
        "/v1/load_lora_adapter",
    ],
)
def test_a_path_that_climbs_out_of_v1_is_not_passed_through(
    standins: Any, ferry: Any, path: str
) -> None:
    """The URL sent on would resolve its dot segments: `/v1/../sleep` is the
    engine's `/sleep`, a route Ferry does not pass through, sent with the
    instance's credentials."""
    [(_, site)] = standins(1)
    proxy = ferry([site.url])
    host, port = proxy.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    connection.request("GET", path)  # as written: http.client resolves nothing
    answer = connection.getresponse()
    assert answer.status == 404
    assert json.loads(answer.read())["error"]["type"] == "not_found_error"
    connection.close()


def test_a_path_is_sent_on_with_its_escapes(standins: Any, ferry: Any) -> None:
    """aiohttp unescapes a path once: sent on as it came out, `%3F` would start
    a query on the engine, and `%2e` be a dot its URL resolves."""
    [(standin, site)] = standins(1)
    proxy = ferry([site.url])
    host, port = proxy.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    connection.request("POST", "/v1/x%253Fy=1/a%2520b", body=b"{}")
    assert connection.getresponse().status == 404  # the stand-in's: no such route
    connection.close()
    assert standin.answers == [("/v1/x%3Fy=1/a%20b", 404)]


CHUNK = (
    b'data: {"id":"c","object":"text_completion","created":1,"model":"standin",'
    b'"choices":[{"index":0,"text":" tok","token_ids":[7],"prompt_token_ids":[1,2,3]}]}\n\n'
)


@pytest.mark.parametrize("migration", ["off", "lite"])
@pytest.mark.parametrize("stream", [False, True])
def test_bytes_that_are_no_http_mid_answer_end_the_call(
    standins: Any, ferry: Any, migration: str, stream: bool
) -> None:
    """aiohttp's parser, meeting a bad chunk size mid-body, failed the connection
    and not the body's reader: the client's request hung, held in the ledger."""
    [(standin, site)] = standins(1, itl_s=0.001)
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    standin.raw_answer = [head + b"%x\r\n%b\r\n" % (len(CHUNK), CHUNK), b"zz\r\nhello\r\n"]
    proxy = ferry([site.url], instances_migration=migration)
    body = {"model": "standin", "prompt": "x", "max_tokens": 3, "stream": stream}
    answer = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
    if stream:  # the first event went on; then the stream ends with an error event
        assert answer.status_code == 200 and answer.text.count('"error"') == 1, answer.text
        assert answer.text.endswith('"}}\n\ndata: [DONE]\n\n')  # then [DONE], as vLLM's
    else:
        assert_openai_error(answer, 502, "upstream_error")
    if not stream or migration == "off":  # (lite: "could not resume", with no one to go to)
        assert "chunk size" in answer.text
    wait_until(lambda: proxy.view("i0").inflight == 0)


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_an_event_that_trickles_in_and_never_ends_is_no_progress(
    standins: Any, ferry: Any, migration: str
) -> None:
    """Bytes every 50 ms, of an event that never ends: each read reset aiohttp's
    idle timer, and the stream (and its place in the ledger) stayed for as long
    as the upstream kept it up. It ends after `upstream_idle_timeout_s` without
    a whole event, as a silent one does."""
    [(standin, site)] = standins(1, itl_s=0.001)
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    trickle = [b"1\r\nx\r\n"] * 100  # 5 s of it
    standin.raw_answer = [
        head + b"%x\r\n%b\r\n" % (len(CHUNK), CHUNK) + b"6\r\ndata: \r\n",
        *trickle,
    ]
    proxy = ferry(
        [site.url], instances_migration=migration, server={"upstream_idle_timeout_s": 0.5}
    )
    body = {"model": "standin", "prompt": "x", "max_tokens": 3, "stream": True}
    began = time.monotonic()
    answer = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
    assert time.monotonic() - began < 3.0  # not the trickle's 5 s
    assert answer.status_code == 200 and answer.text.count('"error"') == 1, answer.text
    assert answer.text.startswith('data: {"id":"c"') and answer.text.endswith("data: [DONE]\n\n")
    if migration == "off":  # (lite: "could not resume", with no one to go to)
        assert "no event but keep-alives for 0.5s" in answer.text
    wait_until(lambda: proxy.view("i0").inflight == 0)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [200, 429])
def test_a_header_http_forbids_is_not_relayed(
    standins: Any, ferry: Any, stream: bool, status: int
) -> None:
    """aiohttp's client reads a control character in a header value; its server
    refuses to write one, which cut the client's connection (a whole answer) or
    framed a 500 inside a chunked answer (a stream)."""
    [(standin, site)] = standins(1, itl_s=0.001)
    body = b'{"error": {}}'  # a 429's (a 200 with one is a failed answer)
    if status == 200:
        body = CHUNK + b"data: [DONE]\n\n" if stream else b'{"id": "c", "choices": []}'
    kind = b"text/event-stream" if stream and status == 200 else b"application/json"
    standin.raw_answer = [
        b"HTTP/1.1 %d X\r\nContent-Type: %b\r\nContent-Length: %d\r\n" % (status, kind, len(body))
        + b"x-engine-note: a\x01b\r\nRetry-After: 1\x7f\r\nx-fine: yes\r\n\r\n"
        + body
    ]
    proxy = ferry([site.url], scheduler={"retries": 0})
    answer = httpx.post(
        proxy.url + "/v1/completions",
        json={"model": "standin", "prompt": "x", "max_tokens": 1, "stream": stream},
        timeout=10,
    )
    assert answer.status_code == status, answer.text
    assert answer.headers["x-fine"] == "yes"
    assert "x-engine-note" not in answer.headers and "retry-after" not in answer.headers
    if status != 200:  # an error's own Content-Type and Content-Encoding go on as they came
        standin.raw_answer = [
            b"HTTP/1.1 429 X\r\nContent-Type: application/json\x01\r\n"
            b"Content-Encoding: x\x01\r\nContent-Length: 13\r\n\r\n" + body
        ]
        again = httpx.post(proxy.url + "/v1/completions", json={"model": "standin", "prompt": "x"})
        assert again.status_code == 429 and again.json() == {"error": {}}
        assert again.headers["content-type"] == "application/json"


@pytest.mark.parametrize("stream", [False, True])
def test_an_interim_status_is_no_answer(standins: Any, ferry: Any, stream: bool) -> None:
    """A 101 from an instance went on to the client, which then waited forever."""
    [(standin, site)] = standins(1, itl_s=0.001)
    standin.raw_answer = [b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n"]
    proxy = ferry([site.url], scheduler={"retries": 0})
    body = {"model": "standin", "prompt": "x", "max_tokens": 1, "stream": stream}
    answer = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
    assert_openai_error(answer, 502, "upstream_error")
    assert "not a final status" in answer.json()["error"]["message"]


def test_a_client_cannot_speak_for_ferry_to_the_shim(standins: Any, ferry: Any) -> None:
    """`ferry_tag` and `ferry_load` in kv_transfer_params are Ferry's word to an
    instance's migration_shim (which one finds a request by, which KV a
    continuation loads): a client's are dropped, its other keys go on."""
    [(standin, site)] = standins(1, itl_s=0)
    proxy = ferry([site.url])
    params = {"ferry_load": {"mig_id": "m", "num_tokens": 9}, "ferry_tag": "t", "mine": 1}
    for stream in (False, True):
        body = {"model": "standin", "prompt": "x", "max_tokens": 1, "stream": stream}
        answer = httpx.post(
            proxy.url + "/v1/completions", json={**body, "kv_transfer_params": params}
        )
        assert answer.status_code == 200, answer.text
        assert standin.seen_bodies[-1]["kv_transfer_params"] == {"mine": 1}


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_chunks_there_only_for_ids_ferry_asked_for_are_left_out(
    standins: Any, ferry: Any, migration: str
) -> None:
    """vLLM's chat sends a token that makes no text as `"delta": {}` only where
    token ids are asked for, and Ferry asks for them on every request: a
    client that did not got a chunk per such token (899 empty chunks of 902 on a
    tiny model's chat). They are left out, still counted, and a stream of them
    longer than the idle timeout is not idle."""
    [(standin, site)] = standins(1, itl_s=0.02)
    standin.silent_tokens = 40  # 0.8 s of tokens with no text
    proxy = ferry(
        [site.url], instances_migration=migration, server={"upstream_idle_timeout_s": 0.5}
    )
    body = {"model": "standin", "max_tokens": 43, "stream": True}
    body["messages"] = [{"role": "user", "content": "x"}]
    answer = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=10)
    assert answer.status_code == 200 and '"error"' not in answer.text, answer.text
    events = [e for e in answer.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 4, events  # 3 tokens with text
    assert "".join(json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-1]) == (
        " tok" * 3
    )
    page = httpx.get(proxy.url + "/metrics").text
    assert 'ferry_generation_tokens_total{instance="i0",model="standin"} 43.0' in page
    asked = httpx.post(
        proxy.url + "/v1/chat/completions", json={**body, "return_token_ids": True}, timeout=10
    )
    assert asked.text.count('"delta":{}') == 40


@pytest.mark.parametrize("order", ["short-first", "long-first"])
def test_the_model_list_gives_the_longest_context_an_instance_offers(
    standins: Any, ferry: Any, order: str
) -> None:
    """Instances of one model with different contexts: `/v1/models` says the
    longest, whatever the configuration's order (it said the first listed), and
    a request that fits it only is served there."""
    (short, site_a), (long, site_b) = standins(2)
    short.max_model_len, long.max_model_len = 40, 4096
    sites = [site_a, site_b] if order == "short-first" else [site_b, site_a]
    proxy = ferry([site.url for site in sites])
    for path in ("/v1/models", "/v1/models/standin"):
        answer = httpx.get(proxy.url + path).json()
        card = answer["data"][0] if "data" in answer else answer
        assert card["max_model_len"] == 4096, answer
    body = {"model": "standin", "prompt": "x", "max_tokens": 100}
    for _ in range(3):
        answer = httpx.post(proxy.url + "/v1/completions", json=body).json()
        assert answer["choices"][0]["text"] == " tok" * 100


@pytest.mark.parametrize("engine", ["vllm", "openai"])
def test_a_stream_with_its_usage_on_the_last_choice_and_no_done_ends_whole(
    standins: Any, ferry: Any, engine: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that puts the usage asked for on the last choice's chunk (not in
    one of its own, as vLLM) and sends no [DONE]: every such stream ended with an
    error event, and the call counted against the instance."""
    [(standin, site)] = standins(1, itl_s=0.001)
    events = (
        b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"a",'
        b'"finish_reason":null}],"usage":null}\n\n',
        b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"b",'
        b'"finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":2,'
        b'"total_tokens":3}}\n\n',
    )
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    standin.raw_answer = [head, *(b"%x\r\n%b\r\n" % (len(e), e) for e in events), b"0\r\n\r\n"]
    proxy = ferry([site.url], instances_engine=engine)
    stream = client(proxy).completions.create(
        model="standin",
        prompt="x",
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == "ab"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 3
    text = urllib.request.urlopen(proxy.url + "/metrics", timeout=5).read().decode()
    assert 'ferry_requests_total{instance="i0",outcome="ok"} 1.0' in text
    assert "failed (stream_broken)" not in caplog.text


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_a_stream_compressed_against_the_ask_is_refused_by_its_encoding(
    standins: Any, ferry: Any, migration: str
) -> None:
    """Ferry asks instances for identity and reads each event of a stream (its
    tokens, its end, a move); one that gzips its stream anyway was a 502 saying
    the stream "ended before its [DONE]". The stream goes to an instance that
    does not; where none is left, the 502 names the encoding."""
    (gzipped, a), (plain, b) = standins(2, itl_s=0.001)
    gzipped.gzip_stream = True
    proxy = ferry(
        [a.url, b.url], instances_migration=migration, scheduler={"policy": "round_robin"}
    )
    chunks = client(proxy).completions.create(
        model="standin", prompt="x", max_tokens=3, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == " tok" * 3
    assert gzipped.served == 1 and plain.served == 1  # tried there first, then elsewhere
    plain.gzip_stream = True
    body = {"model": "standin", "prompt": "x", "max_tokens": 3, "stream": True}
    answer = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
    assert answer.status_code == 502, answer.text
    message = answer.json()["error"]["message"]
    assert "Content-Encoding gzip" in message and "identity" in message, message
    wait_until(lambda: proxy.view("i0").inflight == 0 and proxy.view("i1").inflight == 0)
