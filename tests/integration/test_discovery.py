"""DNS discovery against the system resolver: a name in /etc/hosts stands for a
Kubernetes headless Service, and stand-in servers (not vLLM) on 127.0.0.1 and
127.0.0.2 for its pods. Instances appear with the addresses, disappear (drained,
their streams finished) when one goes, and stay when the name stops resolving."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.standin_server import StandIn
from proxy.config import InstanceConfig
from proxy.fleet import FleetError
from proxy.server import FLEET
from tests.helpers import Ferry, LoopThread, Site, call_json, start_site, wait_until
from tests.integration.test_fleet import join, streams

HOSTS = Path("/etc/hosts")
NAME = "ferry-discovery-test.test"  # .test: reserved, never a real name


def _without_ours(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if NAME not in line.split())


@pytest.fixture
def hosts() -> Iterator[Callable[[list[str]], None]]:
    """Set the addresses NAME resolves to through /etc/hosts; removed after."""
    nsswitch = Path("/etc/nsswitch.conf")
    if nsswitch.exists() and "files" not in next(
        (line for line in nsswitch.read_text().splitlines() if line.startswith("hosts:")), "files"
    ):
        pytest.skip("nsswitch.conf does not consult /etc/hosts")
    if not os.access(HOSTS, os.W_OK):
        pytest.skip("/etc/hosts is not writable (run as root)")

    def point(addresses: list[str]) -> None:
        # Rewritten in place: other lines stay as they are now.
        text = _without_ours(HOSTS.read_text())
        if text and not text.endswith("\n"):
            text += "\n"
        HOSTS.write_text(text + "".join(f"{a} {NAME}\n" for a in addresses))

    yield point
    HOSTS.write_text(_without_ours(HOSTS.read_text()))


def test_instances_follow_dns(
    hosts: Any, loop_thread: LoopThread, ferry: Any, caplog: pytest.LogCaptureFixture
) -> None:
    a = StandIn(itl_s=0.02)
    site_a = loop_thread.run(start_site(a.app(), handler_cancellation=True))
    b = StandIn(itl_s=0.02)
    sites: list[Site] = [site_a]
    try:
        # The same port on the second address, as pods behind one Service.
        sites.append(
            loop_thread.run(
                start_site(b.app(), handler_cancellation=True, host="127.0.0.2", port=site_a.port)
            )
        )
        run_discovery(hosts, a, b, site_a.port, ferry, caplog)
    finally:
        for site in sites:
            loop_thread.run(site.runner.cleanup())


def run_discovery(
    hosts: Any, a: StandIn, b: StandIn, port: int, ferry: Any, caplog: pytest.LogCaptureFixture
) -> None:
    name_a, name_b = f"pool@127.0.0.1:{port}", f"pool@127.0.0.2:{port}"
    hosts(["127.0.0.1", "127.0.0.2"])
    source = {"dns": NAME, "port": port, "refresh_s": 0.1, "name": "pool"}
    proxy: Ferry = ferry([], discovery=[source], scheduler={"policy": "round_robin"})

    # Both found before the first request (the first round runs before serving).
    assert set(proxy.cluster.instances) == {name_a, name_b}
    assert proxy.cluster.instances[name_b].config.url == f"http://127.0.0.2:{port}"
    wait_until(lambda: all(s.healthy for s in proxy.cluster.instances.values()))
    threads, texts = streams(proxy.url, 4, 50)  # 1 s streams, two on each
    wait_until(lambda: a.running == 2 and b.running == 2)

    # 127.0.0.2 leaves the name: drained, its streams end in place, then removed.
    hosts(["127.0.0.1"])
    wait_until(lambda: proxy.cluster.instances[name_b].draining, timeout=5)
    assert b.running == 2
    join(threads)
    assert len(texts) == 4 and all(texts)
    wait_until(lambda: set(proxy.cluster.instances) == {name_a}, timeout=5)

    # It comes back: added again.
    hosts(["127.0.0.1", "127.0.0.2"])
    wait_until(lambda: set(proxy.cluster.instances) == {name_a, name_b}, timeout=5)

    # The name stops resolving: the last set stays, nothing drains.
    hosts([])
    wait_until(lambda: any("did not resolve" in r.getMessage() for r in caplog.records))
    served = a.served + b.served
    threads, texts = streams(proxy.url, 2, 10)
    join(threads)
    assert a.served + b.served == served + 2
    assert set(proxy.cluster.instances) == {name_a, name_b}
    assert not any(s.draining for s in proxy.cluster.instances.values())

    # A reload of the file (no instances in it) leaves discovery's instances alone.
    fleet = proxy.site.app[FLEET]
    summary = proxy.loop.call(fleet.apply, dataclasses.replace(fleet.config, instances=()))
    assert summary["removed"] == [] and summary["restart_required"] == []
    assert set(proxy.cluster.instances) == {name_a, name_b}

    # A file that names an instance discovery found is refused whole.
    clash = dataclasses.replace(
        fleet.config,
        instances=(
            InstanceConfig("other", "http://127.0.0.1:9"),
            fleet.cluster.instances[name_a].config,
        ),
    )
    with pytest.raises(FleetError, match="DNS discovery found"):
        proxy.loop.call(fleet.apply, clash)
    assert set(proxy.cluster.instances) == {name_a, name_b}  # "other" was not added


def test_an_evicted_instance_stays_out_while_dns_names_it(
    hosts: Any, loop_thread: LoopThread, ferry: Any
) -> None:
    """An operator removes a discovered instance (a bad pod): it is not added
    back while its address stays in DNS, and is once the address left and came
    back. An address a configured instance already serves is not added twice."""
    a, b = StandIn(itl_s=0.01), StandIn(itl_s=0.01)
    with two_pods(loop_thread, a, b) as port:
        name_a, name_b = f"pool@127.0.0.1:{port}", f"pool@127.0.0.2:{port}"
        hosts(["127.0.0.1", "127.0.0.2"])
        source = {"dns": NAME, "port": port, "refresh_s": 0.1, "name": "pool"}
        proxy: Ferry = ferry([f"http://127.0.0.1:{port}"], discovery=[source], admin_token="t")
        assert set(proxy.cluster.instances) == {"i0", name_b}  # not name_a: i0 is that engine

        code, _ = call_json(
            f"{proxy.url}/admin/instances/{name_b}", "DELETE", None, {"Authorization": "Bearer t"}
        )
        assert code == 202
        wait_until(lambda: name_b not in proxy.cluster.instances)
        time.sleep(0.5)  # five refreshes that still find it in DNS
        assert set(proxy.cluster.instances) == {"i0"}

        hosts(["127.0.0.1"])
        time.sleep(1.0)  # refreshes without it (every 0.1 s): forgotten
        hosts(["127.0.0.1", "127.0.0.2"])
        wait_until(lambda: name_b in proxy.cluster.instances)
        assert name_a not in proxy.cluster.instances


def test_an_operators_drain_stays_when_its_address_comes_back(
    hosts: Any, loop_thread: LoopThread, ferry: Any
) -> None:
    """An operator drains a discovered pod; its address leaves DNS for a moment
    (its stream still running there) and comes back. The removal is called
    off, the drain is not: it took new requests again, the operator's wish lost."""
    a, b = StandIn(itl_s=0.01), StandIn(itl_s=0.05)
    with two_pods(loop_thread, a, b) as port:
        name_b = f"pool@127.0.0.2:{port}"
        hosts(["127.0.0.1", "127.0.0.2"])
        source = {"dns": NAME, "port": port, "refresh_s": 0.1, "name": "pool"}
        proxy: Ferry = ferry([], discovery=[source], scheduler={"policy": "round_robin"})
        wait_until(lambda: all(s.healthy for s in proxy.cluster.instances.values()))
        threads, texts = streams(proxy.url, 2, 100)  # one on each; 5 s on b
        wait_until(lambda: b.running == 1)
        fleet = proxy.site.app[FLEET]
        proxy.loop.call(lambda: fleet.drain(name_b, migrate=False))
        hosts(["127.0.0.1"])  # gone from DNS: removing, its stream still there
        wait_until(lambda: proxy.cluster.instances[name_b].leaving, timeout=5)
        hosts(["127.0.0.1", "127.0.0.2"])  # back before it was empty
        wait_until(lambda: not proxy.cluster.instances[name_b].leaving, timeout=5)
        assert proxy.cluster.instances[name_b].draining
        join(threads)
        assert texts == [" tok" * 100] * 2


@contextlib.contextmanager
def two_pods(loop_thread: LoopThread, a: StandIn, b: StandIn) -> Iterator[int]:
    """`a` on 127.0.0.1 and `b` on 127.0.0.2, on one port (two pods behind one
    Service): the port."""
    site_a = loop_thread.run(start_site(a.app(), handler_cancellation=True))
    sites: list[Site] = [site_a]
    try:
        sites.append(
            loop_thread.run(
                start_site(b.app(), handler_cancellation=True, host="127.0.0.2", port=site_a.port)
            )
        )
        yield site_a.port
    finally:
        for site in sites:
            loop_thread.run(site.runner.cleanup())
