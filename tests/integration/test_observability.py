"""Following a request: its id and trace context end to end, its access-log line,
and the metrics it leaves, checked by Prometheus's own `promtool` (stand-in servers,
not vLLM)."""

from __future__ import annotations

import json
import logging
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from proxy.ttft_stages import STAGES
from tests.helpers import debian_tool, ferry_process, wait_until

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "ferry.access"]
    return [x for x in lines if not x["path"].startswith("/admin/")]


def lower(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    return urllib.request.urlopen(request, timeout=30)


def test_a_moved_stream_keeps_its_request_id_and_trace_context(
    standins: Any, ferry: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ferry.access")
    caplog.set_level(logging.INFO, logger="ferry.migration")
    (source, a), (dest, b) = standins(2, itl_s=0.02)
    proxy = ferry(
        [a.url, b.url],
        instances_migration="lite",
        admin_token="t",
        scheduler={"policy": "round_robin", "migration_prewarm": False},
        server={"access_log": True},
    )
    trace = {"x-request-id": "req-42", "traceparent": TRACEPARENT, "tracestate": "ferry=1"}
    body = {"model": "standin", "prompt": "hi", "max_tokens": 40, "stream": True}
    events = []
    with post(proxy.url + "/v1/completions", body, trace) as resp:
        assert resp.headers["x-request-id"] == "req-42"
        for line in resp:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 5:
                    drain = urllib.request.Request(
                        proxy.url + "/admin/instances/i0/drain?migrate=true",
                        data=b"",
                        headers={"Authorization": "Bearer t"},
                    )
                    with urllib.request.urlopen(drain, timeout=5) as answer:
                        assert json.load(answer)["migrating"] == 1
    assert "".join(e["choices"][0]["text"] for e in events) == " tok" * 40
    # The first call and the continuation both carry the id and the trace context.
    for standin in (source, dest):
        sent = lower(standin.seen_headers[-1])
        assert sent["x-request-id"] == "req-42"
        assert sent["traceparent"] == TRACEPARENT and sent["tracestate"] == "ferry=1"
    assert dest.seen_bodies[-1]["prompt"][:3] == [1, 2, 3]  # it was the continuation
    wait_until(lambda: bool(access_lines(caplog)))
    [line] = access_lines(caplog)
    assert line["request_id"] == "req-42" and line["status"] == 200 and line["outcome"] == "ok"
    assert (line["model"], line["priority"], line["path"]) == (
        "standin",
        "normal",
        "/v1/completions",
    )
    assert line["instances"] == ["i0", "i1"] and line["instance"] == "i1"
    assert (line["prompt_tokens"], line["completion_tokens"]) == (3, 40)
    assert 0 < line["ttft_s"] <= line["duration_s"]
    [move] = line["migrations"]
    assert (move["from"], move["to"], move["reason"]) == ("i0", "i1", "drain")
    assert move["after_tokens"] >= 5 and 0 <= move["downtime_s"] < line["duration_s"]
    # The log's line for the move names the request as its access line does.
    moved = [r.getMessage() for r in caplog.records if r.name == "ferry.migration"]
    assert any(m.startswith("request req-42 moved i0 -> i1 (drain)") for m in moved), moved


def test_every_answer_has_a_request_id(
    standins: Any, ferry: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ferry.access")
    [(standin, a)] = standins(1, itl_s=0.001)
    proxy = ferry([a.url], server={"access_log": True})
    body = {"model": "standin", "prompt": "hi", "max_tokens": 3}
    with post(proxy.url + "/v1/completions", body) as resp:
        rid = resp.headers["x-request-id"]
    assert len(rid) == 32 and lower(standin.seen_headers[-1])["x-request-id"] == rid
    # A client's id that is no usable header value is replaced.
    with post(proxy.url + "/v1/completions", body, {"x-request-id": "x" * 200}) as resp:
        assert len(resp.headers["x-request-id"]) == 32
    for url, data in (
        (proxy.url + "/v1/completions", {"model": "nope", "prompt": "x"}),  # 404 model
        (proxy.url + "/v1/completions", {"model": 5, "prompt": "x"}),  # 400
        (proxy.url + "/nowhere", {}),  # 404 route
    ):
        with pytest.raises(urllib.error.HTTPError) as err:
            post(url, data, {"x-request-id": "mine-1"})
        with err.value as answer:
            assert answer.headers["x-request-id"] == "mine-1"
            assert "error" in json.load(answer)
    wait_until(lambda: len(access_lines(caplog)) == 5)
    lines = access_lines(caplog)
    assert [x["status"] for x in lines] == [200, 200, 404, 400, 404]
    assert lines[0]["completion_tokens"] == 3 and lines[0]["instance"] == "i0"
    assert lines[2]["instance"] is None and lines[2]["request_id"] == "mine-1"
    assert [x["outcome"] for x in lines] == ["ok", "ok", "model_not_found", None, None]


def test_answers_ferry_gives_itself_are_counted(standins: Any, ferry: Any) -> None:
    """With no instance left to take them, requests were answered 503 and no
    metric moved: an outage read as no traffic on the dashboard."""
    [(_, a)] = standins(1, itl_s=0.001)
    proxy = ferry([a.url], admin_token="a")
    body = {"model": "standin", "prompt": "hi", "max_tokens": 3}
    post(proxy.url + "/v1/completions", body).close()
    drain = urllib.request.Request(
        proxy.url + "/admin/instances/i0/drain", b"", {"Authorization": "Bearer a"}
    )
    urllib.request.urlopen(drain, timeout=5).close()
    for data in (body, body, {"model": "nope", "prompt": "x"}, {"model": 5}):
        with pytest.raises(urllib.error.HTTPError) as err:
            post(proxy.url + "/v1/completions", data)
        err.value.close()
    with pytest.raises(urllib.error.HTTPError) as err:  # (a probe: left out)
        urllib.request.urlopen(proxy.url + "/health", timeout=5)
    err.value.close()
    page = urllib.request.urlopen(proxy.url + "/metrics", timeout=5).read().decode()
    counted = {
        line.split('"')[1]: float(line.split()[-1])
        for line in page.splitlines()
        if line.startswith("ferry_responses_total{")
    }
    assert counted == {"200": 2.0, "503": 2.0, "404": 1.0, "400": 1.0}  # (the drain's 200 too)


def test_probes_and_scrapes_stay_out_of_the_access_log(
    standins: Any, ferry: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ferry.access")
    [(_, a)] = standins(1)
    proxy = ferry([a.url], server={"access_log": True})
    for path in ("/health", "/livez", "/readyz", "/ping", "/metrics", "/v1/models"):
        urllib.request.urlopen(proxy.url + path, timeout=5).close()
    wait_until(lambda: len(access_lines(caplog)) >= 1)
    assert [x["path"] for x in access_lines(caplog)] == ["/v1/models"]


def test_metrics_are_labelled_and_pass_promtool(standins: Any, ferry: Any) -> None:
    tool = debian_tool("promtool", "prometheus")
    [(_, a), (_, b)] = standins(2, itl_s=0.001)
    proxy = ferry([a.url, b.url], admin_token="t", scheduler={"policy": "round_robin"})
    for stream in (True, False):
        body = {"model": "standin", "prompt": "hi", "max_tokens": 4, "stream": stream}
        with post(proxy.url + "/v1/completions", body) as resp:
            resp.read()
    drain = urllib.request.Request(
        proxy.url + "/admin/instances/i1/drain", data=b"", headers={"Authorization": "Bearer t"}
    )
    urllib.request.urlopen(drain, timeout=5).close()
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    checked = subprocess.run(
        [tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    for sample in (
        'ferry_time_to_first_token_seconds_count{instance="i0",model="standin"} 1.0',
        'ferry_inter_token_latency_seconds_count{instance="i0",model="standin"} 3.0',
        'ferry_request_duration_seconds_count{instance="i1",model="standin"} 1.0',
        'ferry_generation_tokens_total{instance="i0",model="standin"} 4.0',
        'ferry_prompt_tokens_total{instance="i1",model="standin"} 3.0',
        'ferry_instance_draining{instance="i1"} 1.0',
    ):
        assert sample in text
    assert "process_cpu_seconds_total" in text and "python_gc_collections_total" in text
    freeness = [x for x in text.splitlines() if x.startswith("ferry_instance_freeness{")]
    assert len(freeness) == 2 and not any("inf" in x.lower() for x in freeness)


def test_with_otel_a_request_is_a_span_under_the_clients_trace(standins: Any, ferry: Any) -> None:
    trace = pytest.importorskip("opentelemetry.trace", reason="the otel extra is not installed")
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = trace.get_tracer_provider()
    if not isinstance(provider, sdk.TracerProvider):  # the process's first: this test's
        provider = sdk.TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    [(standin, a)] = standins(1, itl_s=0.001)
    proxy = ferry([a.url], server={"otel": True})
    body = {"model": "standin", "prompt": "hi", "max_tokens": 3, "stream": True}
    with post(proxy.url + "/v1/completions", body, {"traceparent": TRACEPARENT}) as resp:
        resp.read()
    wait_until(lambda: bool(exporter.get_finished_spans()))
    [span] = exporter.get_finished_spans()
    trace_id, parent_id = TRACEPARENT.split("-")[1:3]
    assert f"{span.context.trace_id:032x}" == trace_id
    assert span.parent is not None and f"{span.parent.span_id:016x}" == parent_id
    assert span.kind is trace.SpanKind.SERVER and span.name == "POST /v1/completions"
    attributes = dict(span.attributes or {})
    assert attributes["ferry.instance"] == "i0" and attributes["gen_ai.usage.output_tokens"] == 3
    assert attributes["http.response.status_code"] == 200
    # The engine is sent Ferry's span as the parent, in the client's trace.
    sent = lower(standin.seen_headers[-1])["traceparent"].split("-")
    assert sent[1] == trace_id and sent[2] == f"{span.context.span_id:016x}"


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_a_streams_ttft_is_broken_down_into_stages(
    standins: Any, ferry: Any, caplog: pytest.LogCaptureFixture, migration: str
) -> None:
    """The plain relay and a movable stream: five stages, in the access log and
    /metrics, that add up to the TTFT; the stand-in's 80 ms before its first
    token shows where it belongs."""
    caplog.set_level(logging.INFO, logger="ferry.access")
    [(_, a)] = standins(1, itl_s=0.001, ttft_s=0.08)
    proxy = ferry([a.url], instances_migration=migration, server={"access_log": True})
    for stream in (True, False):
        body = {"model": "standin", "prompt": "hi", "max_tokens": 3, "stream": stream}
        with post(proxy.url + "/v1/completions", body) as resp:
            resp.read()
    wait_until(lambda: len(access_lines(caplog)) == 2)
    streamed, whole = access_lines(caplog)
    assert whole["ttft_stages_s"] is None  # no first token to time
    stages = streamed["ttft_stages_s"]
    assert list(stages) == list(STAGES)
    assert all(seconds >= 0 for seconds in stages.values())
    # Consecutive stages: they add up to the TTFT (which stops just before the write).
    assert streamed["ttft_s"] <= sum(stages.values()) < streamed["ttft_s"] + 0.005
    assert 0.08 <= stages["upstream_first_byte"] < streamed["ttft_s"]
    for stage in ("parse", "dispatch", "upstream_connect", "relay"):
        assert stages[stage] < 0.05, stages  # Ferry's own part is small
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for stage in STAGES:
        assert f'ferry_time_to_first_token_stage_seconds_count{{stage="{stage}"}} 1.0' in text
    first_byte = [
        x
        for x in text.splitlines()
        if x.startswith('ferry_time_to_first_token_stage_seconds_bucket{le="0.05",')
        and 'stage="upstream_first_byte"' in x
    ]
    assert first_byte == [
        'ferry_time_to_first_token_stage_seconds_bucket{le="0.05",stage="upstream_first_byte"} 0.0'
    ]


def test_what_a_client_names_cannot_forge_a_line_of_ferrys_log(
    standins: Any, tmp_path: Path
) -> None:
    """A field's name holding a newline and a record after it, and a terminal's
    escape, reaches `ferry serve`'s log escaped on its one line: an operator
    reading the log sees no record the client wrote, and no screen cleared."""
    [(_, site)] = standins(1)
    config = {"instances": [{"name": "i0", "url": site.url, "migration": "lite"}]}
    forged = "zz\n2026-12-06 20:00:00,000 ERROR ferry.admin: FORGED\x1b[2J\u2028"
    log_path = tmp_path / "ferry.log"
    with log_path.open("wb") as log_file:
        proc, url = ferry_process(config, tmp_path / "ferry.json", stderr=log_file)
        try:
            stream = OpenAI(base_url=url + "/v1", api_key="x").completions.create(
                model="standin", prompt="hi", max_tokens=2, stream=True, extra_body={forged: 1}
            )
            assert "".join(chunk.choices[0].text for chunk in stream) == " tok" * 2
        finally:
            proc.terminate()
            proc.wait(15)
    lines = log_path.read_text().splitlines()
    assert not [line for line in lines if "FORGED" in line and "not migratable" not in line]
    (line,) = [line for line in lines if "not migratable" in line]
    assert "zz\\x0a2026-12-06" in line and "FORGED\\x1b[2J\\u2028" in line


def test_a_clients_long_model_name_is_cut_in_errors_and_the_log(
    standins: Any, ferry: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A model name of 16 M characters made a 96 MB 404 and a 96 MB log line
    (1.3 s of other clients' stall on the loop for two of them)."""
    caplog.set_level(logging.INFO, logger="ferry.access")
    [(_, a)] = standins(1)
    proxy = ferry([a.url], server={"access_log": True})
    model = "é" * 200_000
    for path, data in (
        ("/v1/completions", {"model": model, "prompt": "x"}),
        ("/v1/embeddings", {"model": model, "input": "x"}),
        ("/v1/models/" + "m" * 20_000, None),  # (the path itself is in the log line)
    ):
        with pytest.raises(urllib.error.HTTPError) as err:
            if data is None:
                urllib.request.urlopen(proxy.url + path, timeout=10)
            else:
                post(proxy.url + path, data)
        with err.value as answer:
            assert answer.code == 404
            message = json.load(answer)["error"]["message"]
        assert len(message) < 400 and "...'" in message, message[:500]
    wait_until(lambda: len(access_lines(caplog)) == 3)
    for line in access_lines(caplog)[:2]:
        assert len(json.dumps(line)) < 4000 and line["outcome"] == "model_not_found"
