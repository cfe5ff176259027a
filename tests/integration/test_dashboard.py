"""The Grafana dashboard against reality: a real Prometheus (Debian's `prometheus`)
scrapes Ferry in front of stand-in engines (not vLLM) under load with a drain that
moves streams, rebalancing, a failing instance (retries, then an ejection); every
PromQL expression in configs/grafana/ferry.json must then return data.

With FERRY_DASHBOARD_DUMP=PATH the panels' range queries are saved for
`python -m loadtest.render_dashboard PATH configs/grafana/ferry.png`.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtest import render_dashboard as dash
from tests.helpers import debian_tool, free_port, wait_until

SCRAPE_S = 1
ROOT = Path(__file__).resolve().parents[2]


def start_prometheus(tmp: Path, ferry: str, engines: list[str]) -> tuple[subprocess.Popen, str]:
    # As configs/prometheus.yml has it: Ferry's metrics carry an `instance` label
    # (the engine instance) that the dashboard reads, so Ferry's labels win.
    hostport = lambda urls: [{"targets": [u.split("//", 1)[1] for u in urls]}]  # noqa: E731
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "scrape_configs": [
            {"job_name": "ferry", "honor_labels": True, "static_configs": hostport([ferry])},
            {"job_name": "vllm", "static_configs": hostport(engines)},
        ],
    }
    (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    process = subprocess.Popen(
        [
            debian_tool("prometheus", "prometheus"),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp / "prometheus.log").open("w"),
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            with urllib.request.urlopen(url + "/-/ready", timeout=1) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError):
            assert process.poll() is None, (tmp / "prometheus.log").read_text()
            return False

    wait_until(ready, timeout=20)
    # Targets reach the scrape loop some seconds after start (discovery updates are
    # batched, 5 s apart): the load starts once every target has been scraped.
    wait_until(lambda: len(dash.query(url, "up == 1")) == 1 + len(engines), timeout=20)
    return process, url


def post(url: str, body: dict[str, Any] | None = None) -> None:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", "Authorization": "Bearer t"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        exc.close()  # a 5xx the client sees is part of the load


def load(proxy: str, stop: threading.Event, worker: int) -> None:
    n = 0
    while not stop.is_set():
        stream = (n + worker) % 3 != 0
        body = {"model": "standin", "prompt": "hi " * 20, "max_tokens": 25, "stream": stream}
        post(proxy + "/v1/completions", body)
        n += 1


def stream_on(proxy: str, instance: str, tries: int = 20) -> http.client.HTTPResponse:
    """A long stream that Ferry placed on `instance`, once its first token is in
    (so that moving it is downtime, not a wait for a first token). Streams that
    land elsewhere are closed; the others' round robin soon lands one there."""
    host, port = proxy.removeprefix("http://").split(":")
    body = json.dumps({"model": "standin", "prompt": "hi", "max_tokens": 400, "stream": True})
    for _ in range(tries):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status == 200 and resp.headers["x-ferry-instance"] == instance:
            assert b'"text"' in resp.read1(65536)
            return resp
        conn.close()
    raise AssertionError(f"no stream landed on {instance} in {tries} tries")


def test_every_dashboard_query_returns_data(standins: Any, ferry: Any, tmp_path: Path) -> None:
    debian_tool("prometheus", "prometheus")
    # A first token after 0.2 s, so that TTFT and end-to-end latency differ.
    (_, a), (_, b), (bad, c) = standins(3, itl_s=0.02, ttft_s=0.2)
    bad.fail_status = 500  # every call fails: retried elsewhere, then the instance is ejected
    proxy = ferry(
        [a.url, b.url, c.url],
        instances_migration="lite",
        admin_token="t",
        scheduler={
            "policy": "round_robin",
            "migration_prewarm": False,
            "eject_after_failures": 2,
            "eject_base_s": 60.0,
            "eject_max_s": 60.0,
            "rebalance_interval_s": 0.5,  # the rescheduler ticks (and plans nothing here)
        },
    )
    process, prometheus = start_prometheus(tmp_path, proxy.url, [a.url, b.url, c.url])
    try:
        started = time.time()
        stop = threading.Event()
        workers = [threading.Thread(target=load, args=(proxy.url, stop, w)) for w in range(4)]
        for w in workers:
            w.start()
        time.sleep(3)
        streaming = stream_on(proxy.url, "i0")
        post(proxy.url + "/admin/instances/i0/drain?migrate=true")  # moves its streams
        time.sleep(2)
        post(proxy.url + "/admin/instances/i0/undrain")
        streaming.close()
        time.sleep(3)
        stop.set()
        for w in workers:
            w.join(30)
        time.sleep(2.5 * SCRAPE_S)  # the last scrapes
        # The scenario did what the panels are for.
        total = lambda expr: sum(float(s["value"][1]) for s in dash.query(prometheus, expr))  # noqa: E731
        assert total('ferry_migrations_total{reason="drain",outcome="ok"}') >= 1
        assert total("ferry_rescheduler_ticks_total") >= 1
        assert total('ferry_retries_total{reason="500"}') >= 2
        assert total('ferry_instance_ejected{instance="i2"}') == 1
        assert total("ferry_migration_downtime_seconds_count") >= 1
        empty = []
        dump: dict[str, Any] = {"start": started, "panels": []}
        for panel in dash.panels():
            shown: dict[str, Any] = {
                "title": panel["title"],
                "unit": panel["fieldConfig"]["defaults"]["unit"],
                "targets": [],
            }
            for target in panel["targets"]:
                expr = dash.substitute(target["expr"])
                result = dash.query(prometheus, expr)
                values = [float(s["value"][1]) for s in result]
                if not any(math.isfinite(v) for v in values):
                    empty.append(f"{panel['title']}: {expr} -> {result}")
                if os.environ.get("FERRY_DASHBOARD_DUMP"):
                    # A short window for the picture: 4 scrapes, as Grafana's $__rate_interval.
                    short = dash.substitute(target["expr"], rate_interval=f"{4 * SCRAPE_S}s")
                    series = dash.query(
                        prometheus, short, start=started, end=time.time(), step=SCRAPE_S
                    )
                    shown["targets"].append({"legend": target["legendFormat"], "result": series})
            dump["panels"].append(shown)
        assert not empty, "\n".join(empty)
        if path := os.environ.get("FERRY_DASHBOARD_DUMP"):
            Path(path).write_text(json.dumps(dump))
    finally:
        process.terminate()
        process.wait(10)


def test_the_shipped_prometheus_config_keeps_ferrys_instance_label() -> None:
    path = ROOT / "configs" / "prometheus.yml"
    if not path.exists():
        pytest.skip("no configs/prometheus.yml")
    jobs = {j["job_name"]: j for j in yaml.safe_load(path.read_text())["scrape_configs"]}
    assert jobs["ferry"].get("honor_labels") is True, (
        "configs/prometheus.yml: the ferry job needs honor_labels: true, or the dashboard"
        " finds exported_instance instead of Ferry's instance label"
    )
