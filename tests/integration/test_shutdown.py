"""Health probes and a graceful SIGTERM, with `ferry serve` as a real process in
front of a stand-in server (not vLLM)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.server import IN_FLIGHT
from tests.helpers import ferry_process, status, wait_until


@contextlib.contextmanager
def serving(config: dict[str, Any], path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`ferry serve` as a process, killed after the test if it did not exit."""
    proc, url = ferry_process(config, path, stderr=subprocess.PIPE)
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


def test_sigterm_stops_readiness_at_once_and_finishes_streams(
    standins: Any, tmp_path: Path
) -> None:
    [(_, site)] = standins(1, itl_s=0.05)  # 100 tokens: a 5 s stream
    # A delay long enough that a loaded machine still sends `late` inside it.
    config = {
        "instances": [{"name": "a", "url": site.url}],
        "scheduler": {"scrape_interval_s": 0.1},
        "server": {"shutdown_delay_s": 2.5, "shutdown_grace_s": 10.0},
    }
    with serving(config, tmp_path / "ferry.yaml") as (proc, url):
        assert status(url + "/livez") == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        texts: list[str] = []

        def one() -> None:
            chunks = client.completions.create(
                model="standin", prompt="x", max_tokens=100, stream=True
            )
            texts.append("".join(c.choices[0].text for c in chunks))

        streaming = threading.Thread(target=one)
        streaming.start()
        time.sleep(0.3)  # the stream is under way
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: status(url + "/readyz") == 503, timeout=2, poll=0.02)
        assert status(url + "/livez") == 200
        # Within the delay a new request is still served.
        late = client.completions.create(model="standin", prompt="x", max_tokens=2)
        assert late.choices[0].text == " tok" * 2
        streaming.join(15)
        assert texts == [" tok" * 100]  # not cut by the shutdown
        assert proc.wait(15) == 0


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_a_stream_past_the_grace_is_cut_when_it_ends_and_told_so(
    standins: Any, tmp_path: Path, migration: str
) -> None:
    """In-flight streams get `shutdown_grace_s` after the delay, not more (aiohttp
    waits its shutdown timeout twice), and one still going then ends with an
    error event that the openai client raises, not a stream that just stops."""
    [(_, site)] = standins(1, itl_s=0.05)  # 400 tokens: a 20 s stream
    delay_s, grace_s = 0.5, 2.0
    server = {"shutdown_delay_s": delay_s, "shutdown_grace_s": grace_s}
    config = {"instances": [{"name": "a", "url": site.url, "migration": migration}]}
    with serving({**config, "server": server}, tmp_path / "ferry.yaml") as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        chunks = client.completions.create(model="standin", prompt="x", max_tokens=400, stream=True)
        next(iter(chunks))  # under way
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        with pytest.raises(openai.APIError, match="shut down before this stream finished"):
            for _ in chunks:
                pass
        cut_s = time.monotonic() - sent
        assert delay_s + grace_s - 0.2 < cut_s < delay_s + grace_s + 3.0, cut_s
        assert proc.wait(10) == 0


def test_readyz_is_503_while_no_instance_can_take_traffic(ferry: Any) -> None:
    proxy = ferry(["http://127.0.0.1:9"])  # nothing listens there
    assert status(proxy.url + "/readyz") == 503
    assert status(proxy.url + "/livez") == 200


def test_requests_cut_by_a_shutdown_are_counted_as_such(
    standins: Any, ferry: Any, loop_thread: Any
) -> None:
    """A stream and a whole request cut when the grace is over are `shutdown` in
    `ferry_requests_total`, not clients that hung up (a deploy would look like
    one), and the stream's client reads why."""
    [(_, site)] = standins(1, itl_s=0.02)  # 200 tokens: 4 s
    proxy = ferry([site.url])
    body = {"model": "standin", "prompt": "x", "max_tokens": 200}
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    chunks = client.completions.create(stream=True, **body)
    next(iter(chunks))
    answered: list[httpx.Response] = []

    def whole() -> None:
        answered.append(httpx.post(proxy.url + "/v1/completions", json=body, timeout=30))

    waiting = threading.Thread(target=whole)
    waiting.start()
    wait_until(lambda: proxy.view("i0").inflight == 2)
    assert loop_thread.run(proxy.site.app[IN_FLIGHT].finish(0.1)) == 2
    with pytest.raises(openai.APIError, match="shut down before this stream finished"):
        for _ in chunks:
            pass
    waiting.join(10)
    # Answered 503 in the OpenAI shape (it used to find its connection closed,
    # as if Ferry had crashed).
    [cut] = answered
    assert cut.status_code == 503 and cut.headers["Retry-After"] == "1", cut
    assert cut.json()["error"]["code"] == "shutting_down"
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'ferry_requests_total{instance="i0",outcome="shutdown"} 2.0' in metrics
    assert "client_disconnect" not in metrics
