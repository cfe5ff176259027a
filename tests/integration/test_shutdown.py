"""Health probes and a graceful SIGTERM, with `ferry serve` as a real process in
front of a stand-in server (not vLLM)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import openai

from tests.helpers import ferry_process, status, wait_until


def test_sigterm_stops_readiness_at_once_and_finishes_streams(
    standins: Any, tmp_path: Path
) -> None:
    [(_, site)] = standins(1, itl_s=0.05)  # 40 tokens: a 2 s stream
    proc, url = ferry_process(
        {
            "instances": [{"name": "a", "url": site.url}],
            "scheduler": {"scrape_interval_s": 0.1},
            "server": {"shutdown_delay_s": 1.0, "shutdown_grace_s": 10.0},
        },
        tmp_path / "ferry.yaml",
        stderr=subprocess.PIPE,
    )
    try:
        assert status(url + "/livez") == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        texts: list[str] = []

        def one() -> None:
            chunks = client.completions.create(
                model="standin", prompt="x", max_tokens=40, stream=True
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
        assert texts == [" tok" * 40]  # not cut by the shutdown
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


def test_readyz_is_503_while_no_instance_can_take_traffic(ferry: Any) -> None:
    proxy = ferry(["http://127.0.0.1:9"])  # nothing listens there
    assert status(proxy.url + "/readyz") == 503
    assert status(proxy.url + "/livez") == 200
