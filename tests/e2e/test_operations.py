"""An operator's day on real vLLM CPU servers, with streams in flight throughout:
a server started with `--api-key` is added at runtime, migration is turned on for
it, the old instance is removed by migration, the file is reloaded twice. Every
stream finishes token-exact."""

from __future__ import annotations

import json
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.vllm_servers import VLLMServer, metric, start_vllm, wait_ready
from proxy.config import load_config
from tests.e2e.test_migration import api, once_at, stream_ids
from tests.helpers import Ferry, call_json, ferry_process, free_port, status, wait_until

KEY = "vllm-e2e-key"
ADMIN = "ops"
TOKENS = 200


@pytest.fixture(scope="module")
def keyed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A third server, started with `--api-key`: it refuses calls without the key."""
    logs = tmp_path_factory.mktemp("vllm-keyed")
    server = start_vllm(tiny_model, free_port(), logs, extra_args=("--api-key", KEY))
    try:
        wait_ready([server])
        yield server
    finally:
        server.stop()


def admin(url: str, method: str, body: Any = None) -> tuple[int, Any]:
    return call_json(url, method, body, {"Authorization": f"Bearer {ADMIN}"})


def names(url: str) -> set[str]:
    return {r["name"] for r in admin(url + "/admin/instances", "GET")[1]}


class Streams:
    """`n` greedy streams through Ferry, each started before the call returns."""

    def __init__(self, url: str, n: int) -> None:
        self.results: list[list[int]] = []
        self.errors: list[BaseException] = []
        started = threading.Barrier(n + 1)
        self.threads = [threading.Thread(target=self._one, args=(url, started)) for _ in range(n)]
        for t in self.threads:
            t.start()
        started.wait(timeout=120)

    def _one(self, url: str, started: threading.Barrier) -> None:
        try:
            ids, _, _ = stream_ids(api(url), False, TOKENS, on_chunk=once_at(3, started.wait))
            self.results.append(ids)
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            self.errors.append(exc)

    def join(self) -> list[list[int]]:
        for t in self.threads:
            t.join(300)
        assert not self.errors, self.errors
        return self.results


def test_an_operators_day_with_streams_in_flight(
    vllm_pair: list[VLLMServer],
    keyed: VLLMServer,
    loop_thread: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The keyed server is real about its key.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(keyed.url + "/v1/models", timeout=5)
    assert refused.value.code == 401
    refused.value.close()
    monkeypatch.setenv("KEYED_API_KEY", KEY)
    first, second = vllm_pair
    path = tmp_path / "ferry.yaml"

    def write(instances: list[dict[str, Any]]) -> None:
        path.write_text(
            json.dumps(
                {
                    "instances": instances,
                    "scheduler": {"scrape_interval_s": 0.1},
                    "admin_token": ADMIN,
                }
            )
        )

    keyed_entry = {"name": "keyed", "url": keyed.url, "api_key": "${KEYED_API_KEY}"}
    write([{"name": "first", "url": first.url, "migration": "lite"}])
    proxy = Ferry(loop_thread, load_config(path), load=lambda: load_config(path))
    try:
        reference, _, _ = stream_ids(api(proxy.url), False, TOKENS, on_chunk=lambda n: None)
        morning = Streams(proxy.url, 3)

        # Add the keyed server (migration off), then turn migration on for it.
        # The admin API reads none of Ferry's environment: it is sent the key
        # itself (the file, below, reads it from the environment).
        code, _ = admin(proxy.url + "/admin/instances", "POST", keyed_entry)
        assert code == 400
        added = {**keyed_entry, "api_key": KEY}
        code, row = admin(proxy.url + "/admin/instances", "POST", added)
        assert code == 201 and "api_key" not in json.dumps(row) and KEY not in json.dumps(row)
        wait_until(lambda: proxy.view("keyed").healthy, timeout=30)
        code, row = admin(proxy.url + "/admin/instances/keyed", "PATCH", {"migration": "lite"})
        assert code == 200 and row["migration"] == "lite"

        # Remove the first server by migration: its streams go on on the keyed one.
        code, row = admin(proxy.url + "/admin/instances/first?migrate=true", "DELETE")
        assert code == 202 and row["migrating"] >= 1
        wait_until(lambda: names(proxy.url) == {"keyed"}, timeout=60)
        assert morning.join() == [reference] * 3
        assert metric(proxy.url, 'ferry_migrations_total{outcome="ok",reason="drain"}') >= 1

        # Reload: the file now names the keyed server and the second one.
        afternoon = Streams(proxy.url, 2)  # on the keyed server, the only one
        write([{**keyed_entry, "migration": "lite"}, {"name": "second", "url": second.url}])
        code, summary = admin(proxy.url + "/admin/reload", "POST")
        assert code == 200 and summary["added"] == ["second"] and summary["removed"] == []
        wait_until(lambda: proxy.view("second").healthy, timeout=30)

        # Reload again without the keyed server: it is drained by migration.
        write([{"name": "second", "url": second.url, "migration": "lite"}])
        code, summary = admin(proxy.url + "/admin/reload", "POST")
        assert code == 200 and summary["removed"] == ["keyed"] and summary["changed"] == ["second"]
        wait_until(lambda: names(proxy.url) == {"second"}, timeout=60)
        assert afternoon.join() == [reference] * 2
        assert metric(proxy.url, 'ferry_migrations_total{outcome="ok",reason="drain"}') >= 2
    finally:
        proxy.close()


def test_sigterm_lets_real_streams_finish(vllm_pair: list[VLLMServer], tmp_path: Path) -> None:
    proc, url = ferry_process(
        {
            "instances": [{"name": "a", "url": vllm_pair[0].url, "migration": "lite"}],
            # A delay the 503 can be seen in on a loaded machine.
            "server": {"shutdown_delay_s": 3, "shutdown_grace_s": 60},
        },
        tmp_path / "ferry.yaml",
    )
    try:
        reference, _, _ = stream_ids(api(vllm_pair[0].url), False, TOKENS, on_chunk=lambda n: None)
        streams = Streams(url, 3)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: status(url + "/readyz") == 503, timeout=5, poll=0.02)
        assert streams.join() == [reference] * 3  # none cut inside the grace period
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
