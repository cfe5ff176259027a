"""Several `ferry serve` processes sharing one cluster view through a real
redis-server, in front of stand-in servers (not vLLM): each sees the others'
load, a drain through one drains everywhere, a process killed with -9 stops
counting within the TTL and gives up the rescheduler lease, and `--workers`
serves one port from several processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.redis_server import start_redis
from proxy.workers import RESTARTED_WORKER
from tests.helpers import call_json, free_port, wait_until
from tests.integration.test_shutdown import status

TOKEN = "ops"
TTL_S, LEASE_TTL_S = 1.0, 2.0  # Ferry's defaults


class FerryProcess:
    """`ferry serve` as a real process; its log is kept for the failure message."""

    def __init__(self, config: Path, port: int, log: Path, *extra: str) -> None:
        self.port, self.url, self.log = port, f"http://127.0.0.1:{port}", log
        command = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)]
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*command, "--port", str(port), *extra], stdout=out, stderr=subprocess.STDOUT
            )

    def admin(self, path: str, method: str = "GET", body: Any = None) -> Any:
        code, answer = call_json(
            self.url + path, method, body, {"Authorization": f"Bearer {TOKEN}"}
        )
        assert code < 300, (code, answer)
        return answer

    def sharing(self) -> dict[str, Any]:
        return dict(self.admin("/admin/sharing"))

    def rows(self) -> dict[str, dict[str, Any]]:
        return {r["name"]: r for r in self.admin("/admin/instances")}

    def inflight(self) -> int:
        return sum(r["inflight"] for r in self.rows().values())

    def wait_ready(self) -> None:
        try:
            wait_until(lambda: status(self.url + "/readyz") == 200, timeout=30)
        except AssertionError:
            raise AssertionError(f"ferry did not start:\n{self.log.read_text()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def ferries(
    standins: Any, redis_server: str, redis_prefix: str, tmp_path: Path
) -> Iterator[Callable[..., list[FerryProcess]]]:
    """Factory: n `ferry serve` processes sharing through Redis, in front of two
    stand-ins (`i0`, `i1`) that stream one token every 50 ms. The first call's
    `kv_blocks`, `migration`, `scheduler`, `sharing`, `redis_url` and `server` hold
    for every process."""
    config = tmp_path / "ferry.yaml"
    started: list[FerryProcess] = []

    def write_config(
        kv_blocks: int,
        migration: str,
        scheduler: dict[str, Any],
        sharing: dict[str, Any],
        redis_url: str,
        server: dict[str, Any],
    ) -> None:
        sites = [site for _, site in standins(2, itl_s=0.05, kv_blocks=kv_blocks)]
        instances = [
            {"name": f"i{n}", "url": s.url, "migration": migration} for n, s in enumerate(sites)
        ]
        body = {
            "instances": instances,
            "admin_token": TOKEN,
            "redis_url": redis_url,
            "sharing": {
                "key_prefix": redis_prefix,
                "ttl_s": TTL_S,
                "lease_ttl_s": LEASE_TTL_S,
                **sharing,
            },
            "scheduler": {"scrape_interval_s": 0.1, **scheduler},
            "server": {"shutdown_delay_s": 0, "shutdown_grace_s": 2, **server},
        }
        config.write_text(json.dumps(body))

    def make(
        n: int,
        *extra: str,
        kv_blocks: int = 1000,
        migration: str = "off",
        scheduler: dict[str, Any] | None = None,
        sharing: dict[str, Any] | None = None,
        redis_url: str = redis_server,
        server: dict[str, Any] | None = None,
    ) -> list[FerryProcess]:
        if not config.exists():
            write_config(
                kv_blocks, migration, scheduler or {}, sharing or {}, redis_url, server or {}
            )
        new = []
        for _ in range(n):
            index = len(started)
            process = FerryProcess(config, free_port(), tmp_path / f"ferry{index}.log", *extra)
            started.append(process)
            new.append(process)
        for process in new:
            process.wait_ready()
        return new

    yield make
    for process in started:
        process.stop()


class Streams:
    """`n` streams of `tokens` tokens through `url`, each under way on return."""

    def __init__(self, url: str, n: int, tokens: int) -> None:
        self.texts: list[str] = []
        self.errors: list[BaseException] = []
        started = threading.Barrier(n + 1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        self.threads = [
            threading.Thread(target=self._one, args=(client, tokens, started)) for _ in range(n)
        ]
        for t in self.threads:
            t.start()
        started.wait(timeout=30)

    def _one(self, client: openai.OpenAI, tokens: int, started: threading.Barrier) -> None:
        first = True
        text = ""
        try:
            chunks = client.completions.create(
                model="standin", prompt="x", max_tokens=tokens, stream=True
            )
            for chunk in chunks:
                text += chunk.choices[0].text
                if first:
                    first = False
                    started.wait(timeout=30)
            self.texts.append(text)
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            self.errors.append(exc)
            if first:
                started.abort()

    def join(self) -> None:
        for t in self.threads:
            t.join(60)


def complete(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    return client.completions.create(model="standin", prompt="x", max_tokens=2).choices[0].text


def test_each_process_sees_the_others_load_and_fleet_changes_apply_everywhere(
    ferries: Any, standins: Any
) -> None:
    a, b = ferries(2)
    wait_until(lambda: len(a.sharing()["peers"]) == 1 and len(b.sharing()["peers"]) == 1)
    streams = Streams(a.url, 4, tokens=100)  # 5 s each
    # B dispatched nothing, yet its view holds A's four streams.
    wait_until(lambda: b.inflight() == 4, timeout=5)
    rows = b.rows()
    assert sum(r["local_inflight"] for r in rows.values()) == 0
    assert sum(r["virtual_blocks"] for r in rows.values()) > 0
    peer_totals = next(iter(b.sharing()["peers"].values()))
    assert sum(t["inflight"] for t in peer_totals.values()) == 4

    # A drain through B drains i0 in A too: A's requests go to i1 only.
    b.admin("/admin/instances/i0/drain", "POST")
    wait_until(lambda: a.rows()["i0"]["draining"], timeout=10)
    before = {n: r["local_inflight"] for n, r in a.rows().items()}
    late = Streams(a.url, 2, tokens=20)
    after = {n: r["local_inflight"] for n, r in a.rows().items()}
    assert after["i0"] <= before["i0"] and after["i1"] == before["i1"] + 2
    # ... and the undrain through A reaches B.
    a.admin("/admin/instances/i0/undrain", "POST")
    wait_until(lambda: not b.rows()["i0"]["draining"], timeout=10)

    # Added through A, changed through B, removed through A: everywhere each time.
    [(_, extra)] = standins(1)
    a.admin("/admin/instances", "POST", {"name": "i2", "url": extra.url})
    wait_until(lambda: "i2" in b.rows(), timeout=10)
    b.admin("/admin/instances/i2", "PATCH", {"migration": "lite"})
    wait_until(lambda: a.rows()["i2"]["migration_configured"] == "lite", timeout=10)
    a.admin("/admin/instances/i2", "DELETE")
    wait_until(lambda: "i2" not in b.rows() and "i2" not in a.rows(), timeout=5)
    # One that starts later reads the removal and, having no i2, has nothing to say.
    [c] = ferries(1)
    assert "i2" not in c.rows() and "not applied here" not in c.log.read_text()
    # A change through one process right after an add through another finds the
    # instance (a script's add, drain, remove: the drain was a 404 a third of
    # the time with `--workers`, and the instance stayed for good).
    # And its server added again under a new name through the first, right after
    # the removal (a 409, "is that server", a quarter of the time).
    for n in range(5):
        a.admin("/admin/instances", "POST", {"name": f"x{n}", "url": f"{extra.url}/{n}"})
        b.admin(f"/admin/instances/x{n}/drain", "POST")
        b.admin(f"/admin/instances/x{n}", "DELETE")
        a.admin("/admin/instances", "POST", {"name": f"y{n}", "url": f"{extra.url}/{n}"})
        b.admin(f"/admin/instances/y{n}", "DELETE")
    gone = {"x0", "x4", "y0", "y4"}
    wait_until(lambda: not gone & (a.rows().keys() | c.rows().keys()), timeout=10)

    for s in (streams, late):
        s.join()
        assert not s.errors, s.errors
    assert streams.texts == [" tok" * 100] * 4 and late.texts == [" tok" * 20] * 2
    wait_until(lambda: a.inflight() == 0 and b.inflight() == 0, timeout=10)


def test_a_removal_through_one_process_waits_for_the_streams_of_every_process(
    ferries: Any,
) -> None:
    """The process that took the removal forgot the instance once its own streams
    were done, while another process still streamed on it: `ferry remove` said
    "done" with streams running, and an undrain through that process was a 404."""
    a, b = ferries(2)
    wait_until(lambda: len(a.sharing()["peers"]) == 1 and len(b.sharing()["peers"]) == 1)
    streams = Streams(b.url, 4, tokens=40)  # 2 s each, all through B
    wait_until(lambda: a.rows()["i0"]["inflight"] > 0, timeout=5)
    a.admin("/admin/instances/i0", "DELETE")
    time.sleep(0.5)
    row = a.rows().get("i0")
    assert row is not None and row["removing"] and row["inflight"] > 0
    # While it waits, the removal can still be called off through the process that took it.
    a.admin("/admin/instances/i0/undrain", "POST")
    wait_until(lambda: not b.rows()["i0"]["removing"], timeout=10)
    a.admin("/admin/instances/i0", "DELETE")
    streams.join()
    assert not streams.errors and streams.texts == [" tok" * 40] * 4
    wait_until(lambda: "i0" not in a.rows() and "i0" not in b.rows(), timeout=10)


def test_a_process_that_starts_after_the_log_was_trimmed_gets_the_fleet_state(
    ferries: Any, standins: Any, redis_server: str, redis_prefix: str
) -> None:
    import redis

    [a] = ferries(1, sharing={"fleet_log_length": 3})
    [(_, extra)] = standins(1)
    a.admin("/admin/instances/i0", "PATCH", {"migration": "lite"})
    for _ in range(3):
        a.admin("/admin/instances/i1/drain", "POST")
        a.admin("/admin/instances/i1/undrain", "POST")
    a.admin("/admin/instances/i1/drain", "POST")
    a.admin("/admin/instances", "POST", {"name": "i2", "url": extra.url})
    a.admin("/admin/instances/i2", "PATCH", {"labels": {"zone": "b"}})
    a.admin("/admin/instances/i0", "PATCH", {"labels": {"zone": "a"}})
    client = redis.Redis.from_url(redis_server)
    try:
        # 11 changes (sent with the next round), of which the log keeps 3.
        state = f"{redis_prefix}:fleet:state"
        wait_until(lambda: b"zone" in (client.hget(state, "i0") or b""), timeout=10)
        assert client.xlen(f"{redis_prefix}:fleet") == 3
        # The first PATCH of i0 is long gone from the log; its compacted state keeps it.
        [b] = ferries(1)
        rows = b.rows()
        assert rows["i0"]["migration_configured"] == "lite"
        assert rows["i0"]["labels"] == {"zone": "a"}
        assert rows["i1"]["draining"] and not rows["i0"]["draining"]
        assert rows["i2"]["labels"] == {"zone": "b"}

        # A process cut off while the log moved past it starts over from the state.
        # As a peer would, in one transaction: i1 undrained, then junk enough to
        # trim that change from the log before b reads it.
        undrain = {"origin": "peer", "op": {"op": "undrain", "name": "i1"}}
        junk = json.dumps({"op": "undrain", "name": "ghost"})
        pipe = client.pipeline(transaction=True)
        pipe.hset(state, "i1", json.dumps([undrain]))
        for _ in range(5):
            pipe.xadd(
                f"{redis_prefix}:fleet", {"origin": "peer", "op": junk}, maxlen=3, approximate=False
            )
        pipe.execute()
        wait_until(lambda: not b.rows()["i1"]["draining"], timeout=10)
        assert "fleet log trimmed past the last change applied here" in b.log.read_text()
    finally:
        client.close()


def test_an_instance_removed_and_added_again_is_the_new_one_everywhere(
    ferries: Any, standins: Any, redis_server: str, redis_prefix: str
) -> None:
    """A file's instance removed, then added again under its name with another
    server, then changed: a process started later kept the file's server (the
    shared state held the add alone, refused there: the name was taken), with
    the changes made to it; and a resync after Redis lost its data must not
    remove the new one from the processes that have it."""
    import redis

    a, b = ferries(2)
    [(_, extra)] = standins(1)
    a.admin("/admin/instances/i1", "DELETE")
    wait_until(lambda: "i1" not in a.rows() and "i1" not in b.rows(), timeout=10)
    a.admin("/admin/instances", "POST", {"name": "i1", "url": extra.url})
    wait_until(lambda: b.rows().get("i1", {}).get("url") == extra.url, timeout=10)
    b.admin("/admin/instances/i1", "PATCH", {"labels": {"zone": "b"}})
    b.admin("/admin/instances/i1/drain", "POST")
    wait_until(lambda: a.rows()["i1"]["draining"] and a.rows()["i1"]["labels"], timeout=10)

    def new_one(process: FerryProcess) -> bool:
        row = process.rows().get("i1")
        return row is not None and (
            row["url"],
            row["labels"],
            row["draining"],
            row["removing"],
        ) == (extra.url, {"zone": "b"}, True, False)

    [late] = ferries(1)  # removes the file's i1, then takes the new one and its changes
    wait_until(lambda: new_one(late), timeout=10)
    assert "not applied here" not in late.log.read_text()

    client = redis.Redis.from_url(redis_server)
    try:
        client.delete(*client.scan_iter(f"{redis_prefix}:*"))
    finally:
        client.close()
    wait_until(lambda: "Redis lost the shared" in a.log.read_text(), timeout=10)
    time.sleep(1.0)  # the write-back, and every process's resync of it
    assert all(new_one(p) for p in (a, b, late)), [
        {k: p.rows()["i1"][k] for k in ("labels", "draining", "removing")} for p in (a, b, late)
    ]


def test_an_add_whose_answer_from_redis_was_lost_is_not_made_twice(
    redis_server: str, redis_prefix: str
) -> None:
    """Redis made the add but its answer was lost (a timeout), so the add stayed
    queued and was sent again: it was refused as another process's add of the
    name, logged twice, and the instance removed here for good."""
    import redis.asyncio as aioredis

    add = {"op": "add", "instance": {"name": "e5", "url": "http://127.0.0.1:9"}}

    async def scenario() -> int:
        process = _bare_process(redis_server, redis_prefix, "a", [1000.0])
        await process._record(add)
        await process._record(add)  # sent again
        return int(await aioredis.Redis.from_url(redis_server).xlen(f"{redis_prefix}:fleet"))

    assert asyncio.run(scenario()) == 1


def test_a_process_started_after_a_reload_makes_the_fleet_the_file_says(
    ferries: Any, standins: Any
) -> None:
    """A reload makes the fleet what the file says: the runtime changes it undid
    are not made again by a process that starts later (they stayed in the
    shared state, and a worker restarted by its supervisor brought an instance
    back that the reload had removed). A drain is not the file's: it stays."""
    a, _ = ferries(2)
    [(_, extra)] = standins(1)
    a.admin("/admin/instances", "POST", {"name": "i2", "url": extra.url})
    a.admin("/admin/instances/i0", "PATCH", {"labels": {"zone": "a"}})
    a.admin("/admin/instances/i1/drain", "POST")
    wait_until(lambda: a.rows()["i0"]["labels"] == {"zone": "a"}, timeout=10)
    summary = a.admin("/admin/reload", "POST")
    assert summary["removed"] == ["i2"] and summary["changed"] == ["i0"]
    [late] = ferries(1)
    rows = late.rows()
    assert set(rows) == {"i0", "i1"} and rows["i0"]["labels"] == {}
    assert rows["i1"]["draining"]


def requests_total(url: str) -> float:
    """The sum of ferry_requests_total over its labels, from one scrape of `url`."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "ferry_requests_total"
    )


def gauges(url: str) -> dict[str, float]:
    """The `ferry_sharing_*` gauges of one scrape of `url`, by their names' tails."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        s.name.removeprefix("ferry_sharing_"): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("ferry_sharing_")
    }


def test_a_scrape_answers_for_every_worker_on_its_port_and_no_more(ferries: Any) -> None:
    [workers] = ferries(1, "--workers", "2")
    [replica] = ferries(1)  # another port, as a replica on another host: scraped apart
    wait_until(lambda: len(replica.sharing()["peers"]) == 2)
    for _ in range(5):
        complete(workers.url)  # each call a new connection: spread over the workers
    for _ in range(2):
        complete(replica.url)
    # Each publishes its exposition once a second; whichever worker a scrape
    # reaches answers for both, and for nobody else.
    wait_until(lambda: all(requests_total(workers.url) == 5 for _ in range(4)), timeout=5)
    assert requests_total(replica.url) == 2


def test_a_scrape_while_redis_is_down_still_counts_every_worker(
    ferries: Any, tmp_path: Path
) -> None:
    """Each worker's own counters alone would make the sum drop and rise from
    scrape to scrape, which Prometheus reads as counter resets: the peers' last
    counters stand in until Redis is back."""
    port = free_port()
    own = start_redis(port, tmp_path)  # this test's own: it is stopped
    try:
        [workers] = ferries(1, "--workers", "2", redis_url=f"redis://127.0.0.1:{port}/0")
        wait_until(lambda: len(workers.sharing()["peers"]) == 1)
        for _ in range(6):
            complete(workers.url)  # each call a new connection: spread over the workers
        wait_until(lambda: all(requests_total(workers.url) == 6 for _ in range(4)), timeout=5)
        # Each worker publishes its counters and reads its peers' once a second: two
        # seconds on, each holds the other's as they are now (before, a read of a
        # peer's older publication would be summed: up to two seconds behind).
        from proxy.sharing import METRICS_EVERY_S  # (redis is imported with it)

        time.sleep(2 * METRICS_EVERY_S + 0.2)
        own.kill()
        own.wait(10)
        wait_until(lambda: all(not workers.sharing()["redis_ok"] for _ in range(4)), timeout=5)
        assert [requests_total(workers.url) for _ in range(8)] == [6] * 8
    finally:
        own.kill()
        own.wait(10)


def test_a_killed_process_stops_counting_within_the_ttl_and_its_lease_moves(
    ferries: Any,
) -> None:
    a, b = ferries(2, scheduler={"rebalance_interval_s": 0.5})  # (the lease is a planner's)
    wait_until(lambda: a.sharing()["lease_holder"] is not None)
    holder_name = a.sharing()["lease_holder"]
    holder, survivor = (a, b) if a.sharing()["process"] == holder_name else (b, a)
    assert holder.sharing()["holds_lease"] and not survivor.sharing()["holds_lease"]
    streams = Streams(holder.url, 3, tokens=200)  # 10 s each
    wait_until(lambda: survivor.inflight() == 3, timeout=5)
    before = survivor.sharing()
    assert list(before["peers"]) == [holder_name]

    holder.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    gone_s = lease_s = None
    while (gone_s is None or lease_s is None) and time.monotonic() - killed < 10:
        state, load = survivor.sharing(), survivor.inflight()
        now = time.monotonic() - killed
        if gone_s is None and not state["peers"] and load == 0:
            gone_s = now
        if lease_s is None and state["holds_lease"]:
            lease_s = now
        time.sleep(0.02)
    # No phantom load: the dead process's totals left the view with their TTL,
    # and the lease passed on with its own (2 s of slack for a loaded machine).
    assert gone_s is not None and gone_s <= TTL_S + 2.0, gone_s
    assert lease_s is not None and lease_s <= LEASE_TTL_S + 2.0, lease_s
    assert survivor.sharing()["lease_holder"] == survivor.sharing()["process"]

    # The survivor serves on; the dead process's streams broke (clients retry).
    assert complete(survivor.url) == " tok" * 2
    streams.join()
    assert len(streams.errors) == 3 and not streams.texts


def test_garbage_in_the_shared_keys_does_not_end_the_sharing(
    ferries: Any, standins: Any, redis_server: str, redis_prefix: str
) -> None:
    """Another writer's data in Ferry's keys (a member name that is not UTF-8,
    a move of the wrong shape): each round still runs, so a fleet change made
    through one process still reaches the other and its load is still seen."""
    import redis

    a, b = ferries(2)
    wait_until(lambda: len(a.sharing()["peers"]) == 1 and len(b.sharing()["peers"]) == 1)
    client = redis.Redis.from_url(redis_server)
    client.sadd(f"{redis_prefix}:members", b"\xff\xfe-not-utf8")
    for process in (a, b):
        moves = f"{redis_prefix}:moves:{process.sharing()['process']}"
        client.rpush(moves, json.dumps([[1], {"not": "a name"}]), b"\xff")
    # Fleet changes of the wrong shape, in the log and in the compacted state a
    # process starting later reads first.
    bad_op = json.dumps({"op": "drain", "name": ["i0"], "migrate": False})
    client.xadd(f"{redis_prefix}:fleet", {"origin": "elsewhere", "op": bad_op})
    state = [{"origin": "elsewhere", "op": {"op": "undrain", "name": {"no": 1}}}]
    client.hset(f"{redis_prefix}:fleet:state", "i1", json.dumps(state))
    time.sleep(3 * 0.05 + 0.5)  # rounds have read them all
    [c] = ferries(1)
    b.admin("/admin/instances/i0/drain", "POST")
    wait_until(lambda: a.rows()["i0"]["draining"] and c.rows()["i0"]["draining"], timeout=10)
    # An added instance's key reaches the peers, not their logs.
    [(_, extra)] = standins(1)
    a.admin("/admin/instances", "POST", {"name": "i2", "url": extra.url, "api_key": "sk-sekrit"})
    wait_until(lambda: "i2" in b.rows() and "i2" in c.rows(), timeout=10)
    streams = Streams(a.url, 2, tokens=100)  # 5 s each
    wait_until(lambda: b.inflight() == 2, timeout=5)
    streams.join()
    assert not streams.errors and streams.texts == [" tok" * 100] * 2
    logs = a.log.read_text() + b.log.read_text() + c.log.read_text()
    assert "sk-sekrit" not in logs
    assert "applied: add i2" in b.log.read_text()
    assert b.log.read_text().count("-not-utf8") <= 1  # dropped once, not every round


def test_workers_serve_one_port_are_restarted_and_withdraw_on_sigterm(
    ferries: Any, redis_server: str, redis_prefix: str, tmp_path: Path
) -> None:
    import redis

    [parent] = ferries(1, "--workers", "2", scheduler={"rebalance_interval_s": 0.5})
    names: set[str] = set()
    deadline = time.monotonic() + 10
    # Each call is a new connection: the kernel spreads them over the workers.
    while len(names) < 2 and time.monotonic() < deadline:
        names.add(parent.sharing()["process"])
    assert len(names) == 2
    wait_until(lambda: len(parent.sharing()["peers"]) == 1)
    assert complete(parent.url) == " tok" * 2

    # A worker killed with -9 is replaced; the port serves throughout. The file
    # changed meanwhile in what only a restart applies: the replacement runs as
    # its siblings do (it used to read the file again, and share under another
    # key prefix, or serve another port).
    path = tmp_path / "ferry.yaml"
    edited = json.loads(path.read_text())
    edited["sharing"]["key_prefix"] = redis_prefix + "-edited"
    path.write_text(json.dumps(edited))
    doomed = sorted(names)[0]
    os.kill(int(doomed.split(":")[1]), signal.SIGKILL)  # names are host:pid:random
    assert complete(parent.url) == " tok" * 2
    seen: set[str] = set()

    def replaced() -> bool:
        state = parent.sharing()
        if state["process"] not in names and len(state["peers"]) == 1:
            seen.add(state["process"])  # a new worker, that sees the other one
        # The dead worker's lease outlives its load record (2 s against 1 s):
        # wait until a survivor holds it, or the graceful stop has nothing to withdraw.
        return (
            bool(seen)
            and doomed not in state["peers"]
            and state["lease_holder"] not in (None, doomed)
        )

    wait_until(replaced, timeout=20)

    parent.proc.send_signal(signal.SIGTERM)
    assert parent.proc.wait(15) == 0, parent.log.read_text()
    # A graceful stop withdraws at once: nothing waits for the TTL.
    client = redis.Redis.from_url(redis_server)
    try:
        assert client.keys(f"{redis_prefix}:load:*") == []
        assert client.smembers(f"{redis_prefix}:members") == set()
        assert client.get(f"{redis_prefix}:lease") is None
    finally:
        client.close()


def test_a_worker_started_again_while_redis_is_down_keeps_the_drains_its_siblings_know(
    ferries: Any, tmp_path: Path
) -> None:
    """It used to serve the file's fleet alone until Redis was back: a drained
    instance got its share of the new requests. It begins from the fleet state
    the other workers keep in the parent's file."""
    from loadtest.redis_server import start_redis

    port = free_port()
    server = start_redis(port, tmp_path)  # its own, to stop
    try:
        [parent] = ferries(1, "--workers", "2", redis_url=f"redis://127.0.0.1:{port}/0")
        names: set[str] = set()
        deadline = time.monotonic() + 10
        while len(names) < 2 and time.monotonic() < deadline:  # a connection each
            names.add(parent.sharing()["process"])
        assert len(names) == 2
        parent.admin("/admin/instances/i0/drain", "POST")
        wait_until(lambda: all(parent.rows()["i0"]["draining"] for _ in range(6)), timeout=10)
        time.sleep(0.5)  # (a round or two: each worker has written its state)
        server.terminate()
        server.wait(10)
        os.kill(int(sorted(names)[0].split(":")[1]), signal.SIGKILL)  # host:pid:random

        def replaced() -> bool:
            try:
                return any(parent.sharing()["process"] not in names for _ in range(6))
            except OSError:  # a connection the killed worker had taken
                return False

        wait_until(replaced, timeout=20)
        served = []
        for _ in range(20):  # a connection each: both workers answer
            answer = httpx.post(
                parent.url + "/v1/completions",
                json={"model": "standin", "prompt": "x", "max_tokens": 1},
                timeout=10,
            )
            served.append(answer.headers["x-ferry-instance"])
        assert served == ["i1"] * 20, served
    finally:
        server.terminate()
        server.wait(10)


def test_one_name_added_through_two_processes_at_once_ends_as_one_instance(
    ferries: Any, standins: Any, redis_server: str, redis_prefix: str
) -> None:
    """Each process made its own add at once (rounds 0.5 s apart), each refused
    the other's, and the fleet stayed split for good: one name, two servers.
    The add logged first stands everywhere; the other process takes it."""
    import redis

    a, b = ferries(2, sharing={"publish_interval_s": 0.5, "ttl_s": 2.0, "lease_ttl_s": 2.0})
    (_, one), (_, two) = standins(2)
    for process, site in ((a, one), (b, two)):
        process.admin("/admin/instances", "POST", {"name": "f", "url": site.url})

    def url_of_f(process: FerryProcess) -> str | None:
        row = process.rows().get("f")
        return None if row is None else str(row["url"])

    def agreed() -> bool:
        return url_of_f(a) is not None and url_of_f(a) == url_of_f(b)

    wait_until(agreed, timeout=20, poll=0.2)
    client = redis.Redis.from_url(redis_server)
    try:
        log = client.xrange(f"{redis_prefix}:fleet")
        adds = [json.loads(fields[b"op"]) for _, fields in log]
        first = next(op["instance"]["url"] for op in adds if op["op"] == "add")
        state = json.loads(client.hget(f"{redis_prefix}:fleet:state", "f"))
    finally:
        client.close()
    assert url_of_f(a) == first and state[0]["op"]["instance"]["url"] == first
    assert complete(a.url) == complete(b.url) == " tok" * 2


def test_a_worker_whose_event_loop_stops_is_killed_and_replaced(ferries: Any) -> None:
    """Stopped (SIGSTOP: to the kernel, as a worker stuck in a call that never
    returns), a worker went on taking its share of the port's new connections
    and answered none, for good. Silent past `worker_timeout_s`, it is killed
    and another takes its place."""
    [parent] = ferries(1, "--workers", "2", server={"worker_timeout_s": 3})
    names: set[str] = set()
    deadline = time.monotonic() + 10
    while len(names) < 2 and time.monotonic() < deadline:  # a connection each
        names.add(parent.sharing()["process"])
    assert len(names) == 2
    frozen = int(sorted(names)[0].split(":")[1])  # host:pid:random
    os.kill(frozen, signal.SIGSTOP)
    try:
        wait_until(lambda: not _alive(frozen), timeout=15)  # 3 s silent, then killed
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGCONT)
    assert "silent for" in parent.log.read_text()

    def replaced() -> bool:
        return any(parent.sharing()["process"] not in names for _ in range(6))

    wait_until(replaced, timeout=20)
    assert all(complete(parent.url) == " tok" * 2 for _ in range(6))  # both answer


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_workers_set_in_the_file_log_and_reload_through_the_admin_api_as_one(
    ferries: Any, tmp_path: Path
) -> None:
    """`server.workers` in the file, not `--workers`: each worker logs as they
    do (it logged nothing but bare warnings). A reload through the admin API,
    which one worker takes, reaches every worker (the others kept the old
    fleet and served a removed instance)."""
    [parent] = ferries(1, server={"workers": 2})
    started = re.compile(r"INFO \[(\d+)\] ferry: ferry listening on")
    wait_until(lambda: len(set(started.findall(parent.log.read_text()))) == 2, timeout=10)
    config = tmp_path / "ferry.yaml"
    body = json.loads(config.read_text())
    body["instances"] = body["instances"][:1]
    config.write_text(json.dumps(body))
    summary = parent.admin("/admin/reload", "POST")
    assert summary["removed"] == ["i1"] and summary["every_worker"]
    # Each call is a new connection: the kernel spreads them over the workers.
    wait_until(lambda: all(set(parent.rows()) == {"i0"} for _ in range(12)), timeout=10)
    assert parent.log.read_text().count("configuration reloaded") >= 2


def test_workers_whose_supervisor_is_killed_shut_down(ferries: Any) -> None:
    [parent] = ferries(1, "--workers", "2")
    pids: set[int] = set()
    deadline = time.monotonic() + 10
    while len(pids) < 2 and time.monotonic() < deadline:
        pids.add(int(parent.sharing()["process"].split(":")[1]))  # host:pid:random
    assert len(pids) == 2
    parent.proc.kill()  # no signal reaches the workers
    parent.proc.wait(10)
    # A check a second, then the graceful stop (no delay, 2 s grace here).
    wait_until(lambda: not any(_alive(p) for p in pids), timeout=10)


def test_the_lease_holder_moves_another_process_s_streams(ferries: Any) -> None:
    # 40 blocks of 16 tokens: three 300-token streams outgrow one instance.
    a, b = ferries(2, kv_blocks=40, migration="lite", scheduler={"rebalance_interval_s": 0.2})
    wait_until(lambda: a.sharing()["lease_holder"] is not None)
    holder, other = (a, b) if a.sharing()["holds_lease"] else (b, a)
    other.admin("/admin/instances/i1/drain", "POST")  # so the streams all start on i0
    wait_until(lambda: holder.rows()["i1"]["draining"], timeout=10)
    streams = Streams(other.url, 3, tokens=300)  # 15 s each
    holder.admin("/admin/instances/i1/undrain", "POST")
    wait_until(lambda: other.rows()["i1"]["local_inflight"] >= 1, timeout=15)
    streams.join()
    assert not streams.errors and streams.texts == [" tok" * 300] * 3
    # Planned by the holder, carried out by the process holding the streams.
    name = other.sharing()["process"]
    assert f" of {name} i0 -> i1" in holder.log.read_text()
    assert "the lease holder's plan" in other.log.read_text()
    assert "the lease holder's plan" not in holder.log.read_text()


@pytest.mark.parametrize("loss", ["flushed", "restarted", "restored from an older snapshot"])
def test_a_redis_that_lost_its_data_gets_the_fleet_state_back(
    ferries: Any, redis_prefix: str, tmp_path: Path, loss: str
) -> None:
    """Redis restarted without persistence, or flushed, forgets the drains, and
    one restarted from a snapshot taken before them (the same epoch) forgets them
    too: the processes that made or applied them write them back, so one that
    starts afterwards drains the same instances, and so does one that started
    before they were written back."""
    import redis

    port = free_port()
    own = start_redis(port, tmp_path)  # this test's own: it is restarted
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        a, b = ferries(2, redis_url=url)
        if loss == "restored from an older snapshot":
            client.save()  # dump.rdb in tmp_path, which the next redis-server loads
        a.admin("/admin/instances/i1/drain", "POST")
        a.admin("/admin/instances/i0", "PATCH", {"labels": {"zone": "a"}})
        wait_until(lambda: b.rows()["i1"]["draining"] and b.rows()["i0"]["labels"] == {"zone": "a"})
        if loss == "flushed":
            client.delete(*client.scan_iter(f"{redis_prefix}:*"))
        else:
            own.kill()
            own.wait(10)
            own = start_redis(port, tmp_path)  # empty: no persistence
        [c] = ferries(1)  # races the write-back: either way it ends drained
        wait_until(lambda: c.rows()["i1"]["draining"], timeout=5)
        assert c.rows()["i0"]["labels"] == {"zone": "a"} and not c.rows()["i0"]["draining"]
        state = client.hgetall(f"{redis_prefix}:fleet:state")
        assert b"drain" in state[b"i1"] and b"zone" in state[b"i0"]
        [d] = ferries(1)
        assert d.rows()["i1"]["draining"] and d.rows()["i0"]["labels"] == {"zone": "a"}
        said = (
            "Redis went back to an older snapshot"
            if "snapshot" in loss
            else "Redis lost the shared"
        )
        assert said in a.log.read_text()
    finally:
        client.close()
        own.kill()
        own.wait(10)


def test_without_redis_each_process_goes_on_alone_until_it_is_back(
    ferries: Any, tmp_path: Path
) -> None:
    port = free_port()
    own = start_redis(port, tmp_path)  # this test's own: it is stopped and started again
    try:
        a, b = ferries(
            2, redis_url=f"redis://127.0.0.1:{port}/0", scheduler={"rebalance_interval_s": 0.5}
        )
        wait_until(lambda: len(a.sharing()["peers"]) == 1)
        shown = gauges(a.url)
        assert shown["redis_up"] == 1.0 and shown["peers"] == 1.0
        wait_until(lambda: gauges(a.url)["lease_held"] + gauges(b.url)["lease_held"] == 1.0)
        streams = Streams(b.url, 2, tokens=200)  # 10 s each
        wait_until(lambda: a.inflight() == 2, timeout=5)
        own.kill()
        own.wait(10)
        # Both serve on; after the TTL each forgets the other's (maybe dead) load.
        assert complete(a.url) == " tok" * 2 and complete(b.url) == " tok" * 2
        wait_until(lambda: not a.sharing()["redis_ok"] and a.inflight() == 0, timeout=TTL_S + 3)
        assert a.sharing()["peers"] == {} and a.sharing()["lease_holder"] is None
        assert gauges(a.url)["redis_up"] == 0.0 and gauges(a.url)["peers"] == 0.0
        # A change now would be made by this process alone, and lost with it.
        code, answer = call_json(
            a.url + "/admin/instances/i0/drain",
            "POST",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert code == 503 and answer["error"]["code"] == "sharing_unavailable", answer
        assert not a.rows()["i0"]["draining"]
        # Neither can know it still holds the lease: after its TTL, nobody rebalances.
        lost = lambda p: not p.sharing()["holds_lease"]  # noqa: E731
        wait_until(lambda: lost(a) and lost(b), timeout=LEASE_TTL_S + 2)
        assert b.inflight() == 2  # its own streams, from its ledger
        own = start_redis(port, tmp_path)
        wait_until(lambda: a.inflight() == 2 and a.sharing()["redis_ok"], timeout=5)
        streams.join()
        assert not streams.errors and streams.texts == [" tok" * 200] * 2
    finally:
        own.kill()
        own.wait(10)


def fleet_state(process: FerryProcess) -> dict[str, Any]:
    rows = process.rows()
    return {"draining": rows["i1"]["draining"], "labels": rows["i0"]["labels"]}


def test_changes_made_at_once_through_two_processes_end_alike_everywhere(
    ferries: Any, redis_server: str, redis_prefix: str
) -> None:
    """A drain through one process and an undrain through another, a few ms
    apart: each made its own at once and the other's when it read it, so each
    ended with the other's. The fleet log orders them, and every process ends
    as that order says, the last change logged winning; patches alike."""
    import redis

    a, b = ferries(2)
    client = redis.Redis.from_url(redis_server)

    try:
        for attempt in range(4):
            calls = [
                (a, "/admin/instances/i1/drain", "POST", None),
                (b, "/admin/instances/i1/undrain", "POST", None),
                (a, "/admin/instances/i0", "PATCH", {"labels": {"by": "a"}}),
                (b, "/admin/instances/i0", "PATCH", {"labels": {"by": "b"}}),
            ]
            if attempt % 2:  # the other way round
                calls = [(b if p is a else a, *rest) for p, *rest in calls]
            threads = [
                threading.Thread(target=p.admin, args=(path, method, body))
                for p, path, method, body in calls
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            # Each change is in the log once its process's next round ran (~50 ms).
            log_key = f"{redis_prefix}:fleet"

            def all_logged(count: int = 4 * (attempt + 1), key: str = log_key) -> bool:
                return bool(client.xlen(key) == count)

            wait_until(all_logged, timeout=10)
            ops = [json.loads(f[b"op"]) for _, f in client.xrange(log_key)]
            logged = {
                "draining": [o["op"] == "drain" for o in ops if o.get("name") == "i1"][-1],
                "labels": [o["changes"]["labels"] for o in ops if o["op"] == "patch"][-1],
            }

            def as_logged(want: dict[str, Any] = logged) -> bool:
                return all(fleet_state(p) == want for p in (a, b))

            wait_until(as_logged, timeout=10)
    finally:
        client.close()


def test_replicas_listing_other_instances_are_told_of(
    ferries: Any, redis_server: str, redis_prefix: str, tmp_path: Path
) -> None:
    """A replica whose file names a server otherwise than the others' gets their
    load and drains by name: each says so, on /admin/sharing at once and in its
    log once the difference has lasted FLEET_MISMATCH_S."""
    [a] = ferries(1)
    rows = a.rows()
    other = tmp_path / "other.yaml"  # i1's server under another name
    body = json.loads((tmp_path / "ferry.yaml").read_text())
    body["instances"] = [
        {"name": "i0", "url": rows["i0"]["url"]},
        {"name": "x", "url": rows["i1"]["url"]},
    ]
    other.write_text(json.dumps(body))
    b = FerryProcess(other, free_port(), tmp_path / "other.log")
    try:
        b.wait_ready()
        names = {p.sharing()["process"]: p for p in (a, b)}
        wait_until(lambda: a.sharing()["other_instances"] == [b.sharing()["process"]])
        assert b.sharing()["other_instances"] == [a.sharing()["process"]]
        wait_until(lambda: "has other instances (names or URLs)" in a.log.read_text(), timeout=10)
        assert len(names) == 2
    finally:
        b.stop()
    wait_until(lambda: a.sharing()["other_instances"] == [], timeout=TTL_S + 3)  # b expired
    [c] = ferries(1)  # the same file as a's: nothing to tell
    wait_until(lambda: a.sharing()["process"] in c.sharing()["peers"])  # c has read a's record
    assert c.sharing()["other_instances"] == [] and a.sharing()["other_instances"] == []


def run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", "--backend", "http://127.0.0.1:9", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_workers_without_redis_refuse_to_start_and_say_why() -> None:
    result = run_serve("--workers", "2", "--port", str(free_port()))
    assert result.returncode == 2
    assert "need a shared cluster view: set redis_url (or --redis URL)" in result.stderr


def test_an_unreachable_redis_fails_the_start(redis_server: str) -> None:
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"  # nothing listens there
    result = run_serve("--redis", url, "--port", str(free_port()))
    assert result.returncode == 1
    assert "cannot share the cluster view through Redis" in result.stderr
    # One line, not a warning first that it could not withdraw (it never joined).
    assert "withdraw" not in result.stderr and "s3cret" not in result.stderr


def test_the_start_line_does_not_show_the_redis_password(redis_server: str, tmp_path: Path) -> None:
    """`${VAR}` keeps the password out of the file; the log showed it whole."""
    import redis

    from loadtest.redis_server import start_redis

    password, port = "s3cret-pw", free_port()
    server = start_redis(port, tmp_path)  # its own: a password on the shared one would stay
    try:
        redis.Redis(port=port).config_set("requirepass", password)
        process = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve", "--backend", "http://127.0.0.1:9"]
            + ["--redis", f"redis://:{password}@127.0.0.1:{port}/0", "--port", str(free_port())],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert process.stderr is not None
            line = next(x for x in process.stderr if "sharing the cluster view" in x)
            assert password not in line and ":***@127.0.0.1" in line, line
        finally:
            process.terminate()
            process.wait(30)
    finally:
        server.terminate()
        server.wait(10)


def test_a_worker_started_again_while_redis_is_down_serves_alone(redis_server: str) -> None:
    """Its first start refuses (above); started again by `--workers`' supervisor
    beside workers that carry on alone, it does as they do and joins later."""
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--backend", "http://127.0.0.1:9",
         "--redis", url, "--port", str(port)],
        env={**os.environ, RESTARTED_WORKER: "1"},
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: status(f"http://127.0.0.1:{port}/health") != 0, timeout=30)
        assert process.poll() is None
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    assert "Redis unreachable, serving with this process's view alone" in err


def test_a_round_that_swallows_its_cancel_still_lets_the_process_stop(
    ferry: Any, standins: Any, redis_server: str, redis_prefix: str, monkeypatch: Any
) -> None:
    """redis-py can swallow a CancelledError that lands inside a call (a worker
    stopped right after it started hung until killed); the rounds then go on,
    and the stop must not wait for them forever."""
    from proxy.sharing import Sharing

    swallowed = threading.Event()
    plain_round = Sharing.round

    async def round_swallowing_its_cancel(self: Sharing) -> None:
        await plain_round(self)
        try:
            await asyncio.sleep(0.2)  # long enough for the stop's cancel to land here
        except asyncio.CancelledError:
            swallowed.set()  # as redis-py may: not raised again

    monkeypatch.setattr(Sharing, "round", round_swallowing_its_cancel)
    sites = [site for _, site in standins(1)]
    proxy = ferry(
        [s.url for s in sites],
        redis_url=redis_server,
        sharing={"key_prefix": redis_prefix, "publish_interval_s": 0.01},
    )
    time.sleep(0.5)  # a few rounds
    proxy.loop.run(asyncio.wait_for(proxy.site.runner.cleanup(), 5))
    assert swallowed.is_set()


class _Stub(SimpleNamespace):  # what a round reads of the rest of a process
    def local_load(self, name: str) -> Any:
        from proxy.peer_load import InstanceLoad

        return InstanceLoad()

    def set_peer_load(self, load: Any) -> None:
        pass

    def local_candidates(self) -> dict[str, Any]:
        return {}

    def apply_op(self, op: Any) -> None:
        pass


def _bare_process(
    redis_server: str,
    redis_prefix: str,
    name: str,
    now: list[float],
    rebalance_s: float = 0.5,
    timeout_s: float | None = None,
) -> Any:
    """A `Sharing` with nothing of a process behind it but its rounds, its clock
    `now[0]`, a rescheduler that ticks every `rebalance_s` (0: never), and a
    Redis client that gives up a call after `timeout_s`."""
    import redis.asyncio as aioredis

    from proxy.config import SharingConfig
    from proxy.sharing import Sharing

    cluster = _Stub(instances={}, ledger=_Stub(on_count=None), shared=False)
    rest = (
        _Stub(announce=None, discovered=frozenset()),
        _Stub(streams={}),
        _Stub(coordinator=None, interval_s=rebalance_s),
    )
    client = aioredis.Redis.from_url(redis_server, socket_timeout=timeout_s)
    settings = SharingConfig(key_prefix=redis_prefix)
    return Sharing(client, settings, cluster, *rest, name=name, clock=lambda: now[0])  # type: ignore[arg-type]


def test_moves_planned_under_a_lease_since_lost_are_not_sent(
    redis_server: str, redis_prefix: str
) -> None:
    """The lease holder plans a move of a peer's stream, then stalls past its
    lease (a paused process) while another takes it. Its next round drops the
    move: the new holder plans from what is true now."""
    import redis.asyncio as aioredis

    async def scenario() -> list[bytes]:
        now = [1000.0]
        a, b = (_bare_process(redis_server, redis_prefix, n, now) for n in "ab")
        for p in (a, a, b, b):
            await p.round()
        assert a.holds_lease() and not b.holds_lease()
        a.send_move("b", 7, "e1", True, "rebalance", source="e0")
        lease_s = a.settings.lease_ttl_s
        await asyncio.sleep(lease_s + 0.2)  # Redis's clock: the lease expires
        now[0] += lease_s + 1  # a's too, paused meanwhile
        await b.round()
        assert b.holds_lease()
        await a.round()
        return await aioredis.Redis.from_url(redis_server).lrange(f"{redis_prefix}:moves:b", 0, -1)

    assert asyncio.run(scenario()) == []


def test_only_a_process_that_rebalances_holds_the_lease(
    redis_server: str, redis_prefix: str
) -> None:
    """A replica with rebalancing off took the lease and kept it: no process
    planned a move. It never takes it, and one reloaded to off gives it back at
    its next round, for one that rebalances to take."""

    async def scenario() -> None:
        now = [1000.0]
        idle = _bare_process(redis_server, redis_prefix, "idle", now, rebalance_s=0.0)
        busy = _bare_process(redis_server, redis_prefix, "busy", now)
        for p in (idle, idle, busy, idle):
            await p.round()
        assert busy.holds_lease() and not idle.holds_lease()
        assert idle.lease_holder == "busy"
        busy.rescheduler.interval_s, idle.rescheduler.interval_s = 0.0, 0.5  # reloaded
        await busy.round()
        assert not busy.holds_lease() and busy.lease_holder is None  # given back at once
        await idle.round()
        assert idle.holds_lease()

    asyncio.run(scenario())


def test_a_round_that_a_hung_redis_runs_late_brings_back_no_dead_process(
    redis_prefix: str, tmp_path: Path
) -> None:
    """Redis hung (SIGSTOP) while a process sent a round and then died: the round
    waited in Redis's socket and ran when it resumed, bringing the dead process's
    load and its lease back for a TTL more. Written with a deadline in Redis's
    clock, it is dropped."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    port = free_port()
    own = start_redis(port, tmp_path)
    url = f"redis://127.0.0.1:{port}/0"

    async def scenario() -> tuple[Any, Any]:
        dead = _bare_process(url, redis_prefix, "dead", [1000.0], timeout_s=0.3)
        for _ in range(2):
            await dead.round()
        assert dead.holds_lease()
        own.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises((RedisError, OSError)):
                await dead.round()  # sent; no answer comes, and the process dies
            await asyncio.sleep(LEASE_TTL_S + 0.3)  # what it wrote before expires meanwhile
        finally:
            own.send_signal(signal.SIGCONT)
        client = aioredis.Redis.from_url(url)
        await asyncio.sleep(0.2)  # Redis runs what waited
        load = await client.get(f"{redis_prefix}:load:dead")
        lease = await client.get(f"{redis_prefix}:lease")
        await client.aclose()
        return load, lease

    try:
        assert asyncio.run(scenario()) == (None, None)
    finally:
        own.kill()
        own.wait(10)
