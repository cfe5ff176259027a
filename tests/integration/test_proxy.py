"""The proxy against in-process stand-in servers (loadtest/standin_server.py, not vLLM)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import urllib.error
import urllib.request
from typing import Any

import httpx
import openai
import pytest

from adapters.vllm import METRICS_NARROW_PATH
from tests.helpers import Ferry, free_port, start_site, wait_until


def post(
    url: str, body: bytes, headers: dict[str, str] | None = None, method: str = "POST"
) -> tuple[int, dict[str, Any], dict[str, str]]:
    request = urllib.request.Request(
        url,
        data=body,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    return _send(request)


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    return _send(urllib.request.Request(url, headers=headers or {}))


def _send(request: urllib.request.Request) -> tuple[int, Any, dict[str, str]]:
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            raw = resp.read()
            status, headers = resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        with exc:  # an unclosed error response leaks its socket
            raw, status, headers = exc.read(), exc.code, dict(exc.headers)
    try:
        return status, json.loads(raw), headers
    except ValueError:
        return status, {"raw": raw.decode()}, headers


def client(proxy: Ferry) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_streams_and_non_streams(standins: Any, ferry: Any) -> None:
    [(standin, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url])
    api = client(proxy)
    chunks = list(api.completions.create(model="standin", prompt="hi", max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == " tok" * 5
    # The proxy asked for token ids for its ledger; the client did not, so it sees none.
    assert all(getattr(c.choices[0], "token_ids", None) is None for c in chunks)
    assert standin.seen_bodies[-1]["return_token_ids"] is True
    whole = api.chat.completions.create(
        model="standin", messages=[{"role": "user", "content": "x"}], max_tokens=3
    )
    assert whole.choices[0].message.content == " tok" * 3
    assert getattr(whole, "prompt_token_ids", None) is None
    stream = api.chat.completions.create(
        model="standin", messages=[{"role": "user", "content": "x"}], max_tokens=4, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == " tok" * 4


def test_a_client_that_asks_for_token_ids_gets_them(standins: Any, ferry: Any) -> None:
    [(_, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url])
    status, body, _ = post(
        proxy.url + "/v1/completions",
        b'{"model":"standin","prompt":"x","max_tokens":2,"return_token_ids":true}',
    )
    assert status == 200 and body["choices"][0]["token_ids"] == [7, 7]


def test_ledger_counts_tokens_and_releases(standins: Any, ferry: Any) -> None:
    [(_, site)] = standins(1, itl_s=0.05)
    proxy = ferry([site.url], scheduler={"scrape_interval_s": 60})
    stream = client(proxy).completions.create(
        model="standin", prompt="x", max_tokens=40, stream=True
    )
    next(iter(stream))
    assert proxy.view("i0").inflight == 1
    entries = proxy.loop.call(lambda: list(proxy.cluster.ledger.entries("i0")))
    assert entries[0].prompt_tokens == 3 and entries[0].prompt_exact  # corrected from the engine
    list(stream)
    wait_until(lambda: proxy.view("i0").inflight == 0)


def test_a_whole_answer_stops_counting_as_a_queued_prefill_once_its_engine_queues_nothing(
    standins: Any, ferry: Any
) -> None:
    """Ferry sees a whole answer's tokens only at its end; the engine's empty
    queue (the stand-in reports 0 waiting) says it started well before."""
    [(standin, site)] = standins(1, itl_s=0.05)
    proxy = ferry([site.url], scheduler={"scrape_interval_s": 0.05})
    body = {"model": "standin", "prompt": "x " * 50, "max_tokens": 80}  # 4 s
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, proxy.url + "/v1/completions", json=body, timeout=30)
        wait_until(lambda: standin.running == 1)
        wait_until(lambda: proxy.view("i0").queued_tokens == 0, timeout=2)
        assert proxy.view("i0").inflight == 1 and not answer.done()
        assert answer.result().status_code == 200
    wait_until(lambda: proxy.view("i0").inflight == 0)


def test_burst_spreads_by_ledger_between_scrapes(standins: Any, ferry: Any) -> None:
    sites = standins(2, itl_s=0.02)
    # Scrapes far apart: only Ferry's own ledger can tell the instances apart.
    # Distinct prompts, so the prefix credit has nothing to follow (one hot
    # prompt's bound: tests/unit/test_policies.py).
    proxy = ferry([s.url for _, s in sites], scheduler={"scrape_interval_s": 60})
    api = client(proxy)
    streams = [
        api.completions.create(
            # 6 s streams: all ten still running when the last has begun
            model="standin",
            prompt=f"{n} " + "x" * 300,
            max_tokens=300,
            stream=True,
        )
        for n in range(10)
    ]
    for s in streams:
        next(iter(s))
    assert [proxy.view(n).inflight for n in ("i0", "i1")] == [5, 5]
    for s in streams:
        s.close()


def test_client_disconnect_aborts_upstream(standins: Any, ferry: Any) -> None:
    [(standin, site)] = standins(1, itl_s=0.05)
    proxy = ferry([site.url])
    stream = client(proxy).completions.create(
        model="standin", prompt="x", max_tokens=1000, stream=True
    )
    next(iter(stream))
    assert standin.running == 1
    stream.close()
    wait_until(lambda: standin.running == 0)
    wait_until(lambda: proxy.view("i0").inflight == 0)


def test_a_client_that_leaves_before_a_whole_answer_is_counted(standins: Any, ferry: Any) -> None:
    """A whole answer's headers come with its end: a client gone before then
    is a client_disconnect in ferry_requests_total (it was counted nowhere)."""
    [(_, site)] = standins(1, itl_s=0.02)
    proxy = ferry([site.url])
    body = {"model": "standin", "prompt": "x", "max_tokens": 100}  # 2 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(proxy.url + "/v1/completions", json=body, timeout=0.5)
    wait_until(lambda: proxy.view("i0").inflight == 0)
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'ferry_requests_total{instance="i0",outcome="client_disconnect"} 1.0' in metrics


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param"),
    [
        ("/v1/completions", b"{bad json", {}, 400, None),
        ("/v1/completions", b'{"model": 5, "prompt": "x"}', {}, 400, "model"),
        ("/v1/chat/completions", b'{"model": "standin"}', {}, 400, "messages"),
        ("/v1/completions", b'{"model": "nope", "prompt": "x"}', {}, 404, "model"),
        (
            "/v1/completions",
            b'{"model": "standin", "prompt": "x"}',
            {"x-ferry-priority": "now"},
            400,
            None,
        ),
        # Passed through unread (a Responses call, /tokenize): the header is read.
        (
            "/v1/responses",
            b'{"model": "standin", "input": "x"}',
            {"x-ferry-priority": "now"},
            400,
            None,
        ),
        (
            "/tokenize",
            b'{"model": "standin", "prompt": "x"}',
            {"x-ferry-priority": "now"},
            400,
            None,
        ),
        (
            "/v1/completions",
            b'{"model": "standin", "prompt": "' + b"x" * 34_000_000 + b'"}',  # > 32 MiB
            {},
            413,
            None,
        ),
    ],
)
def test_bad_input_gets_openai_errors(
    standins: Any,
    ferry: Any,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
    param: str | None,
) -> None:
    [(_, site)] = standins(1)
    proxy = ferry([site.url])
    got, payload, _ = post(proxy.url + path, body, headers)
    assert got == status
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["param"] == param


def test_openai_client_sees_typed_errors(standins: Any, ferry: Any) -> None:
    [(_, site)] = standins(1)
    api = client(ferry([site.url]))
    with pytest.raises(openai.NotFoundError, match="not served here"):
        api.completions.create(model="nope", prompt="x")


def test_before_any_instance_was_reached_a_model_is_unavailable_not_unknown(ferry: Any) -> None:
    """An engine still loading (vLLM takes a minute) has said nothing of its
    models: 503 with Retry-After, which clients retry, not a 404 they give up on."""
    proxy = ferry([f"http://127.0.0.1:{free_port()}"])  # nothing listens there yet
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1}).encode()
    status, payload, headers = post(proxy.url + "/v1/completions", body)
    assert status == 503 and "Retry-After" in headers, payload
    assert "not reached yet" in payload["error"]["message"]
    with pytest.raises(openai.InternalServerError):
        client(proxy).completions.create(model="tiny", prompt="x")


def test_unknown_route_and_method(standins: Any, ferry: Any) -> None:
    [(_, site)] = standins(1)
    proxy = ferry([site.url])
    status, payload, _ = get(proxy.url + "/nothing")
    assert status == 404 and payload["error"]["type"] == "not_found_error"
    status, payload, headers = post(proxy.url + "/health", b"")
    assert status == 405 and "error" in payload and "GET" in headers["Allow"]


def test_upstream_errors_pass_through_or_become_502(standins: Any, ferry: Any) -> None:
    [(standin, site)] = standins(1)
    proxy = ferry([site.url])
    standin.fail_status = 400
    status, payload, _ = post(proxy.url + "/v1/completions", b'{"model":"standin","prompt":"x"}')
    assert status == 400 and payload["error"]["message"] == "stand-in told to fail"
    standin.fail_status = 500
    status, payload, _ = post(proxy.url + "/v1/completions", b'{"model":"standin","prompt":"x"}')
    assert status == 502 and "HTTP 500" in payload["error"]["message"]


def test_no_healthy_instance_gives_503_with_retry_after(
    standins: Any, ferry: Any, loop_thread: Any
) -> None:
    [(_, site)] = standins(1)
    proxy = ferry([site.url], scheduler={"unhealthy_after_failures": 1})
    loop_thread.run(site.runner.cleanup())
    wait_until(lambda: not proxy.view("i0").healthy)
    status, payload, headers = post(
        proxy.url + "/v1/completions", b'{"model":"standin","prompt":"x"}'
    )
    assert status == 503 and headers["Retry-After"] == "1"
    assert payload["error"]["type"] == "service_unavailable"
    assert get(proxy.url + "/health")[0] == 503


@pytest.mark.parametrize(
    "body",
    [
        b'vllm:num_requests_running{engine="0"} NaN\n',
        b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="+Inf"} 1.0\n'
        b'vllm:num_requests_running{engine="0"} 1.0\n',
        b"\xff\xfe not UTF-8\n",
    ],
    ids=["nan", "inf", "not-utf8"],
)
def test_a_bad_metrics_answer_is_a_failed_scrape_and_scraping_goes_on(
    standins: Any, ferry: Any, body: bytes
) -> None:
    """Whatever an engine's /metrics answers, its instance's scrape loop lives:
    unhealthy while the answers are bad, healthy again once they are not."""
    [(standin, site)] = standins(1)
    proxy = ferry([site.url], scheduler={"scrape_interval_s": 0.05, "unhealthy_after_failures": 2})
    wait_until(lambda: proxy.view("i0").healthy)
    standin.metrics_body = body
    wait_until(lambda: not proxy.view("i0").healthy)
    assert 'ferry_scrape_errors_total{instance="i0"}' in get(proxy.url + "/metrics")[1]["raw"]
    standin.metrics_body = None
    wait_until(lambda: proxy.view("i0").healthy)


def test_load_is_read_by_name_once_that_reads_as_the_whole_page(standins: Any, ferry: Any) -> None:
    """The first look reads both pages; from then on only the narrow one."""
    [(standin, site)] = standins(1)
    proxy = ferry([site.url], scheduler={"scrape_interval_s": 0.05})
    wait_until(lambda: len(standin.metrics_reads) >= 4)
    assert standin.metrics_reads[:2] == ["by name", "whole"]
    assert set(standin.metrics_reads[2:]) == {"by name"}, standin.metrics_reads
    assert proxy.cluster.instances["i0"].metrics_path == METRICS_NARROW_PATH
    assert proxy.view("i0").capacity_blocks == standin.kv_blocks


@pytest.mark.parametrize("engine", ["cannot filter", "filters out its cache size"])
def test_an_engine_not_read_alike_by_name_is_read_whole(
    standins: Any, ferry: Any, engine: str
) -> None:
    [(standin, site)] = standins(1)
    if engine == "cannot filter":
        standin.metrics_by_name = False  # a 404
    else:
        standin.metrics_by_name_drops = frozenset({"vllm:cache_config_info"})
    proxy = ferry([site.url], scheduler={"scrape_interval_s": 0.05})
    wait_until(lambda: standin.metrics_reads.count("whole") >= 3)
    assert standin.metrics_reads.count("by name") <= 1
    assert proxy.cluster.instances["i0"].metrics_path == "/metrics"
    assert proxy.view("i0").healthy
    assert proxy.view("i0").capacity_blocks == standin.kv_blocks


def test_a_narrow_look_fails_once_and_is_checked_again_not_given_up(
    standins: Any, ferry: Any
) -> None:
    """A second failure in a row would read the whole page for good: looks are
    0.5 s apart, so the test has time to end the first before the next look."""
    [(standin, site)] = standins(1)
    proxy = ferry([site.url], scheduler={"scrape_interval_s": 0.5})
    state = proxy.cluster.instances["i0"]
    wait_until(lambda: state.metrics_path == METRICS_NARROW_PATH)
    standin.metrics_by_name = False  # one failed look by name
    wait_until(lambda: state.metrics_path != METRICS_NARROW_PATH)
    standin.metrics_by_name = True
    assert state.metrics_path is None  # to be checked again, not given up
    wait_until(lambda: state.metrics_path == METRICS_NARROW_PATH)
    assert proxy.view("i0").healthy


def test_a_first_look_whose_whole_page_fails_still_reads_the_load_by_name(
    standins: Any, ferry: Any
) -> None:
    [(standin, site)] = standins(1)
    standin.metrics_whole_fails = True
    proxy = ferry([site.url], scheduler={"scrape_interval_s": 0.05})
    wait_until(lambda: proxy.view("i0").healthy)
    assert proxy.view("i0").capacity_blocks == standin.kv_blocks
    assert proxy.cluster.instances["i0"].metrics_path is None  # not checked yet
    standin.metrics_whole_fails = False
    wait_until(lambda: proxy.cluster.instances["i0"].metrics_path == METRICS_NARROW_PATH)


def test_an_answer_no_check_foresaw_is_a_failed_scrape_from_the_first_look(
    standins: Any, ferry: Any
) -> None:
    """`/v1/models` with `data` that is not a list: Ferry starts, the instance
    serves no model while it answers so (its load reads fine: it is healthy,
    and says why), and its models after."""
    [(standin, site)] = standins(1)
    standin.models_body = b'{"data": 5}'
    proxy = ferry([site.url], scheduler={"scrape_interval_s": 0.05, "unhealthy_after_failures": 1})
    state = proxy.cluster.instances["i0"]
    assert not proxy.view("i0").models and "not a list" in (state.models_error or "")
    standin.models_body = None
    wait_until(lambda: proxy.view("i0").models == frozenset({"standin"}))


def test_connection_failure_is_retried_on_another_instance(
    standins: Any, ferry: Any, loop_thread: Any
) -> None:
    (_, dead), (alive_standin, alive) = standins(2, itl_s=0.001)
    # Scrapes far apart: the proxy still believes the dead instance is healthy.
    proxy = ferry(
        [dead.url, alive.url], scheduler={"scrape_interval_s": 60, "policy": "round_robin"}
    )
    loop_thread.run(dead.runner.cleanup())
    api = client(proxy)
    for _ in range(4):
        out = api.completions.create(model="standin", prompt="x", max_tokens=2)
        assert out.choices[0].text == " tok" * 2
    assert alive_standin.served == 4
    assert not proxy.view("i0").healthy  # marked on the failed connection


def test_a_request_its_engine_hangs_up_on_leaves_the_instance_in_use(
    standins: Any, ferry: Any
) -> None:
    """An engine that takes the connection and drops it (twice: Ferry tries a
    second connection) may be choking on the request: it goes to another
    instance, and the first one still takes everyone else's requests. Marked
    unreachable, as when it refuses connections, one client's requests could
    take every instance out until their next scrapes."""
    (choking, a), (other, b) = standins(2, itl_s=0.001)
    proxy = ferry([a.url, b.url], scheduler={"scrape_interval_s": 60, "policy": "round_robin"})
    with client(proxy) as api:
        for _ in range(2):
            choking.drop_next = 2
            out = api.completions.create(model="standin", prompt="x", max_tokens=2)
            assert out.choices[0].text == " tok" * 2
        assert proxy.view("i0").healthy and proxy.view("i1").healthy
        for _ in range(4):
            api.completions.create(model="standin", prompt="x", max_tokens=2)
    assert choking.served >= 1 and choking.drop_next == 0


def test_a_call_dropped_while_its_engine_worked_is_not_sent_there_again(
    standins: Any, ferry: Any
) -> None:
    """An engine that closes the connection a while after it took a request (it
    died generating a whole answer) had the request sent to it again, as to a
    stale pooled connection: on an engine still up the generation ran twice, and
    on one that is gone the client's error said it could not connect. It goes
    to another instance, counted as a broken call, not a failed connect."""
    (dropping, a), (other, b) = standins(2, itl_s=0.001)
    dropping.drop_after_s = 1.0
    proxy = ferry([a.url, b.url], scheduler={"scrape_interval_s": 60, "policy": "round_robin"})
    with client(proxy) as api:
        for _ in range(2):  # round robin: one of them goes to the dropping one first
            out = api.completions.create(model="standin", prompt="x", max_tokens=2)
            assert out.choices[0].text == " tok" * 2
    dropped = len(dropping.seen_bodies)  # each once: none sent there again
    assert dropped >= 1 and other.served == 2
    text = get(proxy.url + "/metrics")[1]["raw"]
    assert f'ferry_requests_total{{instance="i0",outcome="upstream_error"}} {dropped}.0' in text
    assert 'ferry_requests_total{instance="i0",outcome="connect_error"} 0.0' in text
    assert proxy.view("i0").healthy


def test_admin_requires_the_token_and_drains(standins: Any, ferry: Any) -> None:
    sites = standins(2, itl_s=0.001)
    proxy = ferry([s.url for _, s in sites], admin_token="sekret")
    for refused in (
        get(proxy.url + "/admin/instances"),
        get(proxy.url + "/admin/instances", {"Authorization": "Bearer wrong"}),
    ):
        status, body, headers = refused
        assert status == 401 and body["error"]["code"] == "invalid_token"
        assert headers["WWW-Authenticate"] == "Bearer"  # (RFC 9110: a 401 names its scheme)
    auth = {"Authorization": "Bearer sekret"}
    status, rows, _ = get(proxy.url + "/admin/instances", auth)
    assert status == 200
    assert {r["name"] for r in rows} == {"i0", "i1"}
    assert {"name", "url", "healthy", "draining", "freeness", "inflight"} <= set(rows[0])
    status, row, _ = post(proxy.url + "/admin/instances/i0/drain", b"", auth)
    assert status == 200 and row["draining"] is True
    api = client(proxy)
    for _ in range(6):
        api.completions.create(model="standin", prompt="x", max_tokens=1)
    assert sites[0][0].served == 0 and sites[1][0].served == 6
    post(proxy.url + "/admin/instances/i0/undrain", b"", auth)
    assert post(proxy.url + "/admin/instances/zz/drain", b"", auth)[0] == 404


def test_an_admin_body_is_read_as_a_client_s_gzip_included(standins: Any, ferry: Any) -> None:
    """With Ferry taking bodies as they come, the admin API read a gzip one as
    its compressed bytes: "must be a JSON object"."""
    import gzip

    (_, a), (_, b) = standins(2, itl_s=0.001)
    proxy = ferry([a.url], admin_token="t")
    added = gzip.compress(json.dumps({"name": "i1", "url": b.url}).encode())
    headers = {"Authorization": "Bearer t", "Content-Encoding": "gzip"}
    status, row, _ = post(proxy.url + "/admin/instances", added, headers)
    assert status == 201 and row["name"] == "i1", row
    status, error, _ = post(proxy.url + "/admin/instances", b"junk", headers)
    assert status == 400 and "does not decode as gzip" in error["error"]["message"]


def test_an_admin_body_with_a_key_given_twice_is_refused(standins: Any, ferry: Any) -> None:
    """Read with plain json.loads, the last of two keys applied, unsaid; a
    client's body with one is refused, and so is an operator's now."""
    [(_, a)] = standins(1, itl_s=0.001)
    proxy = ferry([a.url], admin_token="t")
    twice = b'{"labels": {"tier": "a"}, "labels": {"tier": "b"}}'
    status, error, _ = post(
        proxy.url + "/admin/instances/i0", twice, {"Authorization": "Bearer t"}, "PATCH"
    )
    assert status == 400 and "duplicate key 'labels'" in error["error"]["message"], error
    assert error["error"]["type"] == "invalid_request_error"
    status, error, _ = post(proxy.url + "/admin/instances", b"[]", {"Authorization": "Bearer t"})
    assert status == 400 and "must be a JSON object" in error["error"]["message"], error
    # A flag that is no yes or no was read as no: the instance removed at once.
    for route, method in (("/admin/instances/i0", "DELETE"), ("/admin/instances/i0/drain", "POST")):
        url = f"{proxy.url}{route}?migrate=maybe"
        status, error, _ = post(url, b"", {"Authorization": "Bearer t"}, method)
        assert status == 400 and "migrate: must be true or false" in error["error"]["message"]
    status, rows, _ = get(proxy.url + "/admin/instances", {"Authorization": "Bearer t"})
    assert [(r["name"], r["draining"]) for r in rows] == [("i0", False)]


def test_admin_is_off_without_a_token(standins: Any, ferry: Any) -> None:
    [(_, site)] = standins(1)
    status, payload, _ = get(ferry([site.url]).url + "/admin/instances")
    assert status == 403 and payload["error"]["code"] == "admin_disabled"


def test_models_health_metrics_and_passthrough(standins: Any, ferry: Any) -> None:
    (_, a), (_, b) = standins(1, model="alpha")[0], standins(1, model="beta")[0]
    proxy = ferry([a.url, b.url])
    with client(proxy) as api:
        assert sorted(m.id for m in api.models.list()) == ["alpha", "beta"]
        out = api.completions.create(model="beta", prompt="x", max_tokens=1)
        emb = api.embeddings.create(model="alpha", input="x")
    assert out.model == "beta"  # routed by model
    assert emb.data[0].embedding == [0.0, 1.0]
    assert get(proxy.url + "/health")[0] == 200
    request = urllib.request.Request(proxy.url + "/metrics")
    with urllib.request.urlopen(request, timeout=5) as resp:
        text = resp.read().decode()
    for name in (
        "ferry_requests_total",
        "ferry_time_to_first_token_seconds",
        "ferry_inter_token_latency_seconds",
        "ferry_inflight_requests",
        "ferry_instance_freeness",
        "ferry_scrape_age_seconds",
        "ferry_dispatch_decision_seconds",
        "ferry_scrape_errors_total",
    ):
        assert name in text, name
    assert 'ferry_requests_total{instance="i1",outcome="ok"} 1.0' in text
    # The failures each instance may count exist from the start, at 0: a
    # dashboard's increase() misses the first of a series born at 1.
    for outcome in ("connect_error", "upstream_error", "upstream_5xx", "stream_broken"):
        assert f'ferry_requests_total{{instance="i0",outcome="{outcome}"}} 0.0' in text


def test_full_mode_without_the_shim_runs_lite_and_says_why(standins: Any, ferry: Any) -> None:
    from proxy.cli import format_table

    [(_, site)] = standins(1)  # a stand-in server (not vLLM) has no migration_shim
    proxy = ferry([site.url], admin_token="sekret", instances_migration="full")
    assert proxy.cluster.instances["i0"].migration_mode == "lite"
    status, rows, _ = get(proxy.url + "/admin/instances", {"Authorization": "Bearer sekret"})
    assert status == 200
    row = rows[0]
    assert row["migration"] == "lite" and row["migration_configured"] == "full"
    assert row["shim"] is None and "shim not loaded" in row["shim_error"]
    assert "lite (no shim)" in format_table(rows)


def test_a_body_nested_fifty_thousand_deep_is_a_400(standins: Any, ferry: Any) -> None:
    [(_, site)] = standins(1)
    proxy = ferry([site.url])
    hostile = b'{"model": "standin", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    for path in ("/v1/completions", "/v1/embeddings"):
        request = urllib.request.Request(
            proxy.url + path, data=hostile, headers={"Content-Type": "application/json"}
        )
        try:
            urllib.request.urlopen(request, timeout=10).close()
            raise AssertionError("accepted")
        except urllib.error.HTTPError as exc:
            with exc:
                assert exc.code == 400, path
                assert json.load(exc)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("failure", [500, 503, 429])
def test_a_failed_answer_is_retried_on_another_instance(
    standins: Any, ferry: Any, failure: int
) -> None:
    (bad, bad_site), (good, good_site) = standins(2, itl_s=0.001)
    bad.fail_status = failure
    proxy = ferry([bad_site.url, good_site.url], scheduler={"policy": "round_robin"})
    api = client(proxy)
    for i in range(4):  # round robin: each request meets the failing one first
        if i % 2:
            out = api.completions.create(model="standin", prompt="x", max_tokens=2)
            assert out.choices[0].text == " tok" * 2
        else:
            chunks = api.completions.create(model="standin", prompt="x", max_tokens=2, stream=True)
            assert "".join(c.choices[0].text for c in chunks) == " tok" * 2
    assert good.served == 4 and [s for _, s in bad.answers] == [failure] * 4
    text = get(proxy.url + "/metrics")[1]["raw"]
    assert f'ferry_retries_total{{reason="{failure}"}} 4.0' in text


def test_a_whole_answer_cut_after_its_headers_is_retried_on_another_instance(
    standins: Any, ferry: Any
) -> None:
    # Nothing reached the client yet, so another instance can still answer.
    (bad, bad_site), (good, good_site) = standins(2, itl_s=0.001)
    bad.break_whole = True
    # No scrape after the first: a good one clears the error read at the end.
    scheduler = {"policy": "round_robin", "scrape_interval_s": 60}
    proxy = ferry([bad_site.url, good_site.url], scheduler=scheduler)
    for _ in range(2):  # round robin: each meets the breaking instance first
        out = client(proxy).completions.create(model="standin", prompt="x", max_tokens=3)
        assert out.choices[0].text == " tok" * 3
    # A pass-through answer (sent on as it came) alike: it is read whole first.
    for _ in range(2):
        vector = client(proxy).embeddings.create(model="standin", input="x")
        assert vector.data[0].embedding == [0.0, 1.0]
    assert bad.served == 4 and good.served == 4
    text = get(proxy.url + "/metrics")[1]["raw"]
    assert 'ferry_retries_total{reason="upstream_error"} 4.0' in text
    # What is held against the instance says what broke, not only that it did.
    last_error = proxy.loop.call(lambda: proxy.cluster.instances["i0"].last_error)
    assert last_error and last_error != "upstream_error"
    bad_site_only = ferry([bad_site.url])
    status, payload, _ = post(
        bad_site_only.url + "/v1/completions", b'{"model":"standin","prompt":"x"}'
    )
    assert status == 502 and payload["error"]["type"] == "upstream_error"


def test_a_client_error_is_not_retried_and_retries_run_out(standins: Any, ferry: Any) -> None:
    (a, site_a), (b, site_b) = standins(2)
    proxy = ferry([site_a.url, site_b.url], scheduler={"policy": "round_robin", "retries": 1})
    a.fail_status = b.fail_status = 400
    status, _, _ = post(proxy.url + "/v1/completions", b'{"model":"standin","prompt":"x"}')
    assert status == 400 and len(a.answers) + len(b.answers) == 1  # the client's error: once
    a.fail_status = b.fail_status = 429
    status, payload, headers = post(
        proxy.url + "/v1/completions", b'{"model":"standin","prompt":"x"}'
    )
    assert status == 429 and headers["Retry-After"] == "1"  # both busy: passed through
    a.fail_status = b.fail_status = 500
    status, payload, _ = post(proxy.url + "/v1/completions", b'{"model":"standin","prompt":"x"}')
    assert status == 502 and "HTTP 500" in payload["error"]["message"]
    assert len(a.answers) + len(b.answers) == 5  # 1 + 2 + 2: never twice on one instance


def test_a_prompt_too_long_for_one_instance_goes_to_one_it_fits(standins: Any, ferry: Any) -> None:
    """Instances of one model with different contexts: a prompt past one's
    context goes where it fits; where Ferry could not tell (a card that says
    more than the engine takes: restarted with a shorter context, its models
    not read again yet), the engine's 400 is tried again where the context is
    longer; and it is the client's answer where no instance has a longer one."""
    (small, site_small), (big, site_big), (twin, site_twin) = standins(3)
    small.max_model_len, big.max_model_len, twin.max_model_len = 50, 4096, 50
    proxy = ferry([site_small.url, site_big.url], scheduler={"policy": "round_robin"})

    def ask(api: openai.OpenAI, i: int) -> None:
        prompt = list(range(100 * i, 100 * i + 60))  # 60 token ids
        answer = api.completions.create(model="standin", prompt=prompt, max_tokens=2)
        assert answer.choices[0].text == " tok" * 2

    with client(proxy) as api:
        for i in range(4):
            ask(api, i)
    assert small.answers == [] and [status for _, status in big.answers] == [200] * 4
    card = {"id": "standin", "object": "model", "max_model_len": 100}
    small.models_body = json.dumps({"object": "list", "data": [card]}).encode()
    unknown = ferry([site_small.url, site_big.url], scheduler={"policy": "round_robin"})
    with client(unknown) as api:
        for i in range(4):  # round robin: `small` first, at least once
            ask(api, i)
    refused = len(small.answers)
    assert refused >= 1 and small.answers == [("/v1/completions", 400)] * refused
    text = httpx.get(unknown.url + "/metrics").text
    assert f'ferry_retries_total{{reason="400"}} {refused:.1f}' in text
    small.models_body = None
    alike = ferry([site_small.url, site_twin.url])
    with client(alike) as api, pytest.raises(openai.BadRequestError, match="context length"):
        api.completions.create(model="standin", prompt=list(range(60)), max_tokens=2)
    assert len(small.answers) + len(twin.answers) == refused + 1  # none longer: once


def test_a_failure_with_nowhere_else_to_go_is_no_retry_and_bills_no_prompt(
    standins: Any, ferry: Any
) -> None:
    """One instance, and it answers 500 (then 400): the request is not tried
    again, and says so; the prompt it refused is not counted as served."""
    [(standin, site)] = standins(1)
    proxy = ferry([site.url], scheduler={"retries": 1})
    for status in (500, 400):
        standin.fail_status = status
        answer = httpx.post(
            proxy.url + "/v1/completions", json={"model": "standin", "prompt": "word " * 400}
        )
        assert answer.status_code == (502 if status == 500 else 400)
    assert len(standin.answers) == 2
    text = httpx.get(proxy.url + "/metrics").text
    assert "ferry_retries_total{" not in text
    assert 'ferry_requests_total{instance="i0",outcome="upstream_5xx"} 1.0' in text
    assert "ferry_prompt_tokens_total{" not in text


def test_failing_instance_is_ejected_with_a_doubling_backoff(
    standins: Any, ferry: Any, loop_thread: Any
) -> None:
    (bad, bad_site), (good, good_site) = standins(2, itl_s=0.001)
    bad.fail_status = 500
    proxy = ferry(
        [bad_site.url, good_site.url],
        admin_token="t",
        scheduler={
            "policy": "round_robin",
            "eject_after_failures": 2,
            # Long enough that the checks below all run inside the first
            # ejection on a loaded machine (CI runs vLLM servers beside it).
            "eject_base_s": 2.0,
            "eject_max_s": 20,
        },
    )
    api = client(proxy)

    def send_four() -> None:
        for _ in range(4):
            assert api.completions.create(model="standin", prompt="x", max_tokens=1).choices

    send_four()  # round robin meets the bad one twice: ejected
    assert len(bad.answers) == 2
    rows = {
        r["name"]: r for r in get(proxy.url + "/admin/instances", {"Authorization": "Bearer t"})[1]
    }
    assert rows["i0"]["ejected_for_s"] and not proxy.view("i0").dispatchable
    text = get(proxy.url + "/metrics")[1]["raw"]
    assert 'ferry_instance_ejected{instance="i0"} 1.0' in text
    assert 'ferry_ejections_total{instance="i0"} 1.0' in text
    send_four()
    assert len(bad.answers) == 2  # ejected: nothing reached it
    wait_until(lambda: proxy.view("i0").dispatchable, timeout=5)  # back after 2 s
    send_four()  # fails twice more: ejected again, for twice as long
    assert len(bad.answers) == 4
    first = proxy.loop.call(proxy.cluster.ejected_for, "i0")
    assert 2.0 < first <= 4.0
    assert 'ferry_ejections_total{instance="i0"} 2.0' in get(proxy.url + "/metrics")[1]["raw"]


def test_a_request_every_instance_fails_ejects_none(standins: Any, ferry: Any) -> None:
    """A body the engines answer with a 500 (vLLM does, for some stop strings)
    fails on every instance it is tried on: that is the request's doing, and a
    client repeating it must not eject the cluster."""
    (a, a_site), (b, b_site) = standins(2, itl_s=0.001)
    proxy = ferry(
        [a_site.url, b_site.url],
        scheduler={"policy": "round_robin", "eject_after_failures": 2, "eject_base_s": 60.0},
    )
    a.fail_status = b.fail_status = 500
    for _ in range(6):
        status, _, _ = post(proxy.url + "/v1/completions", b'{"model":"standin","prompt":"x"}')
        assert status == 502
    assert len(a.answers) == len(b.answers) == 6  # each request on both
    a.fail_status = b.fail_status = None
    assert proxy.view("i0").dispatchable and proxy.view("i1").dispatchable
    status, _, _ = post(proxy.url + "/v1/completions", b'{"model":"standin","prompt":"x"}')
    assert status == 200


def test_an_instance_back_from_a_failure_is_asked_its_models_again(
    standins: Any, ferry: Any, loop_thread: Any
) -> None:
    """A server restarted on its port may serve another model: a look at
    `/v1/models` waits for no `models_refresh_s` once the instance was down."""
    (restarted, site), (_, other) = standins(2, itl_s=0.001)
    scheduler = {"scrape_interval_s": 0.05, "models_refresh_s": 60, "unhealthy_after_failures": 1}
    proxy = ferry([site.url, other.url], scheduler=scheduler)
    wait_until(lambda: proxy.view("i0").healthy)
    loop_thread.run(site.runner.cleanup())  # the process stops...
    wait_until(lambda: not proxy.view("i0").healthy)
    restarted.model = "other"  # ... and another starts on its port
    port = int(site.url.rsplit(":", 1)[1])
    back = loop_thread.run(start_site(restarted.app(), port=port))
    try:
        wait_until(lambda: "other" in {m["id"] for m in get(proxy.url + "/v1/models")[1]["data"]})
    finally:
        loop_thread.run(back.runner.cleanup())


def test_the_last_instance_serving_a_model_is_not_ejected(standins: Any, ferry: Any) -> None:
    """With nowhere else to go, a request is better sent to an instance that
    fails some calls than refused: ejection waits until another can take over."""
    (bad, bad_site), (other, other_site) = standins(2, itl_s=0.001)
    bad.fail_status = 500
    proxy = ferry(
        [bad_site.url, other_site.url],
        admin_token="t",
        scheduler={"policy": "round_robin", "eject_after_failures": 2, "eject_base_s": 60.0},
    )
    drain = urllib.request.Request(
        proxy.url + "/admin/instances/i1/drain", data=b"", headers={"Authorization": "Bearer t"}
    )
    urllib.request.urlopen(drain, timeout=5).close()
    for _ in range(4):
        status, _, headers = post(
            proxy.url + "/v1/completions", b'{"model":"standin","prompt":"x"}'
        )
        # i0 fails each; the draining i1 answers it, as nothing else is left
        assert status == 200 and headers["x-ferry-instance"] == "i1"
    assert len(bad.seen_bodies) == 4 and other.served == 4
    assert proxy.view("i0").dispatchable  # failing, but the only one new requests go to
    undrain = urllib.request.Request(
        proxy.url + "/admin/instances/i1/undrain", data=b"", headers={"Authorization": "Bearer t"}
    )
    urllib.request.urlopen(undrain, timeout=5).close()
    wait_until(lambda: proxy.view("i1").dispatchable)
    for _ in range(2):  # round robin: its next failure finds a spare
        status, _, _ = post(proxy.url + "/v1/completions", b'{"model":"standin","prompt":"x"}')
        assert status == 200  # retried on i1 where i0 failed
    assert not proxy.view("i0").dispatchable


def test_a_whole_answer_compressed_against_the_ask_reaches_the_client_readable(
    standins: Any, ferry: Any
) -> None:
    """Ferry asks instances for identity; one that compresses anyway has its
    Content-Encoding passed on with the bytes, so the client can read them."""
    [(standin, site)] = standins(1)
    standin.gzip_whole = True
    proxy = ferry([site.url])
    out = client(proxy).completions.create(model="standin", prompt="x", max_tokens=3)
    assert out.choices[0].text == " tok" * 3


def test_a_whole_answer_its_client_never_reads_is_hung_up_on(standins: Any, ferry: Any) -> None:
    """aiohttp writes a handler's answer with no timeout: a client that asked for
    a large answer and reads none of it held it, and its memory, for as long
    as it kept its socket open. It is hung up on after `client_send_timeout_s`,
    as a stream's client is, and counted a client gone, not a call that went well."""
    import socket

    [(_, site)] = standins(1, itl_s=0)
    proxy = ferry([site.url], server={"client_send_timeout_s": 1})
    body = json.dumps({"model": "standin", "prompt": "x", "max_tokens": 3_000_000}).encode()
    host, port = proxy.url.removeprefix("http://").split(":")
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: 12 MB won't fit
    client.connect((host, int(port)))
    try:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        outcome = 'ferry_requests_total{instance="i0",outcome="client_disconnect"} 1.0'
        wait_until(lambda: outcome in httpx.get(proxy.url + "/metrics").text, timeout=20)
        client.settimeout(10)
        received = 0
        with contextlib.suppress(ConnectionResetError):
            while chunk := client.recv(1 << 20):
                received += len(chunk)
        assert received < len(" tok") * 3_000_000  # hung up on: the rest never came
    finally:
        client.close()


def test_a_priority_header_sent_twice_reads_as_its_values_joined(standins: Any, ferry: Any) -> None:
    """Two `x-ferry-priority` lines are the same header as their values joined
    by a comma (RFC 9110), which a proxy in front may do: alike, they are one
    priority; different, both forms are refused, not the first line taken."""
    [(_, site)] = standins(1)
    proxy = ferry([site.url])
    body = json.dumps({"model": "standin", "prompt": "x", "max_tokens": 1}).encode()
    answers = []
    for lines in ([("high",), ("high",)], [("high",), ("low",)], [("high, low",)]):
        headers = [("Content-Type", "application/json")] + [
            ("x-ferry-priority", value) for (value,) in lines
        ]
        answers.append(httpx.post(proxy.url + "/v1/completions", content=body, headers=headers))
    assert [a.status_code for a in answers] == [200, 400, 400]
    assert "not several" in answers[1].json()["error"]["message"]


def test_a_responses_call_is_placed_by_its_priority(
    standins: Any, ferry: Any, loop_thread: Any
) -> None:
    """A Responses call, passed through unread, was placed as normal whatever
    its `x-ferry-priority` said, and a bad one was taken: it generates as a chat
    does, and is billed (headroom, room made) by its priority."""
    [(standin, site)] = standins(1, itl_s=0.001)
    gate = asyncio.Event()  # the stand-in holds the rest of its stream until this is set
    standin.responses_gate = gate
    proxy = ferry([site.url])
    body = {"model": "standin", "input": "x", "max_output_tokens": 3, "stream": True}
    headers = {"x-ferry-priority": "high"}
    with httpx.stream("POST", proxy.url + "/v1/responses", json=body, headers=headers) as answer:
        lines = answer.iter_lines()
        next(lines)  # under way
        try:
            assert proxy.loop.call(proxy.cluster.ledger.high_priority, "i0") == 1
        finally:
            loop_thread.call(gate.set)
        assert "response.completed" in "".join(lines)
    long = {"x-ferry-priority": "x" * 5000}
    refused = httpx.post(proxy.url + "/v1/responses", json=body, headers=long)
    assert refused.status_code == 400 and len(refused.text) < 500  # the value shown cut short
