"""The rescheduler with a shared view: only the lease holder plans, over every
process's movable streams, and a peer's stream is moved by that peer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from proxy import placement
from proxy.cluster import Cluster
from proxy.config import InstanceConfig
from proxy.peer_load import InstanceLoad
from proxy.policy import Priority, UsageSettings
from proxy.policy.migration import MigrationSettings, RequestLoad
from proxy.rescheduler import Rescheduler
from tests.unit.test_cluster import make_cluster, snapshot


class Placement:
    """Both instances take moves; the view is the real one, over the real cluster."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def migration_instances(self) -> set[str]:
        return {"a", "b"}

    view_of = placement.Placement.view_of


class Migrator:
    """The parts of proxy/migrator.py the rescheduler uses: streams here, by instance."""

    def __init__(self, cluster: Cluster, candidates: dict[str, list[RequestLoad]]) -> None:
        self.placement = Placement(cluster)
        self.free_slots = 2
        self._candidates = candidates
        self.streams = {r.id: f"stream {r.id}" for loads in candidates.values() for r in loads}
        self.submitted: list[tuple[Any, str | None, str, bool]] = []

    def candidates(self, instance: str) -> list[RequestLoad]:
        return self._candidates.get(instance, [])

    def submit(self, stream: Any, destination: str | None, reason: str, prewarm: bool) -> None:
        self.submitted.append((stream, destination, reason, prewarm))


class Coordinator:
    def __init__(self, holds: bool, peers: dict[str, dict[str, list[RequestLoad]]]) -> None:
        self.holds, self.peers = holds, peers
        self.sent: list[tuple[str, int, str, bool, str]] = []
        self.sources: list[str] = []

    def holds_lease(self) -> bool:
        return self.holds

    def peer_candidates(self) -> Mapping[str, Mapping[str, Sequence[RequestLoad]]]:
        return self.peers

    def send_move(
        self,
        owner: str,
        request_id: int,
        destination: str,
        prewarm: bool,
        reason: str,
        *,
        source: str,
    ) -> None:
        self.sent.append((owner, request_id, destination, prewarm, reason))
        self.sources.append(source)


def queued(request_id: int) -> RequestLoad:
    return RequestLoad(request_id, 64, Priority.NORMAL, running=False)


def rescheduler(
    local: dict[str, list[RequestLoad]], coordinator: Coordinator
) -> tuple[Rescheduler, Migrator]:
    cluster = make_cluster("a", "b")
    # a is over its 100 blocks by what a peer placed there; b is idle.
    cluster.set_peer_load({"a": InstanceLoad(150, 5, 0, 0)})
    migrator = Migrator(cluster, local)
    planner = Rescheduler(cluster, migrator, MigrationSettings(), interval_s=1)  # type: ignore[arg-type]
    planner.coordinator = coordinator
    return planner, migrator


def test_the_holder_sends_a_peer_s_stream_to_that_peer() -> None:
    coordinator = Coordinator(True, {"p1": {"a": [queued(42)]}})
    planner, migrator = rescheduler({}, coordinator)
    assert planner.tick() == 1
    # The peer's own id; queued: no warming.
    assert coordinator.sent == [("p1", 42, "b", False, "rebalance")]
    assert coordinator.sources == ["a"]  # where it was planned off
    assert migrator.submitted == []


def test_the_holder_moves_its_own_streams_itself() -> None:
    coordinator = Coordinator(True, {})
    planner, migrator = rescheduler({"a": [queued(3)]}, coordinator)
    assert planner.tick() == 1
    assert migrator.submitted == [("stream 3", "b", "rebalance", False)]
    assert coordinator.sent == []
    # What this process publishes for a holder elsewhere: its movable streams on a.
    assert planner.local_candidates() == {"a": [queued(3)]}


def test_without_the_lease_nothing_is_planned() -> None:
    coordinator = Coordinator(False, {"p1": {"a": [queued(42)]}})
    planner, migrator = rescheduler({"a": [queued(3)]}, coordinator)
    assert planner.tick() == 0
    assert coordinator.sent == [] and migrator.submitted == []


def test_a_preempted_stream_is_rescued_even_with_every_slot_taken() -> None:
    """Moves in flight fill the migrator's slots: no rebalancing move is planned,
    but a stream its engine preempted (a's engine queues two requests, the peer's
    queued one and one the ledger has streamed tokens of; stream 2 went silent)
    moves at once, unwarmed."""
    silent = RequestLoad(2, 64, Priority.NORMAL, running=True, silent_s=1.0)
    busy = RequestLoad(3, 64, Priority.NORMAL, running=True, silent_s=0.01)
    coordinator = Coordinator(True, {"p1": {"a": [queued(42)]}})
    planner, migrator = rescheduler({"a": [silent, busy]}, coordinator)
    planner.cluster.record_scrape("a", snapshot(running=2, waiting=2, kv_usage=0.9), now=1.0)
    migrator.free_slots = 0
    assert planner.tick() == 1
    assert migrator.submitted == [("stream 2", "b", "rescue", False)]
    assert coordinator.sent == []  # the peer's queued request waits for a free slot


def test_a_tick_that_fails_does_not_end_rebalancing(caplog: Any) -> None:
    """A coordinator that raises (a bug, data no check foresaw) loses that tick,
    not the loop: the next ticks run, and the failure is logged once."""
    import asyncio

    class Flaky(Coordinator):
        calls = 0

        def holds_lease(self) -> bool:
            Flaky.calls += 1
            if Flaky.calls <= 2:
                raise KeyError("gone")
            return True

    planner, _ = rescheduler({}, Flaky(True, {}))
    planner.interval_s = 0.01

    async def run() -> None:
        planner.start()
        await asyncio.sleep(0.2)
        assert planner._task is not None and not planner._task.done()
        await planner.stop()

    asyncio.run(run())
    assert Flaky.calls > 3
    assert caplog.text.count("a rescheduler tick failed") == 1


def test_a_planned_move_of_a_stream_that_went_on_elsewhere_is_dropped() -> None:
    """The lease holder planned the move off `a`; by the time it arrives the
    stream failed over to `c` by itself: moving it again would spend a resume
    and take it off the healthy instance it went to."""
    import json
    from types import SimpleNamespace

    from proxy.config import SharingConfig
    from proxy.sharing import Sharing

    stream = SimpleNamespace(instance="c", movable=True)
    submitted: list[tuple[Any, ...]] = []
    migrator = SimpleNamespace(streams={7: stream}, submit=lambda *a: submitted.append(a))
    cluster = make_cluster("a", "b", "c")
    sharing = Sharing(None, SharingConfig(), cluster, None, migrator, None, name="p")  # type: ignore[arg-type]
    sharing._apply_move(json.dumps([7, "b", True, "rebalance", "a"]))
    assert submitted == []
    sharing._apply_move(json.dumps([7, "b", True, "rebalance", "c"]))
    sharing._apply_move(json.dumps([7, "b"]))  # an older peer's: no source said
    assert [a[1:3] for a in submitted] == [("b", "rebalance")] * 2


def test_a_scrape_while_redis_fails_does_not_wait_on_it() -> None:
    """With Redis frozen, each /metrics scrape waited out an MGET (0.5 s) the
    process knew would fail: it serves the peers' counters as last read."""
    import asyncio

    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from proxy.config import SharingConfig
    from proxy.sharing import Sharing

    def exposition(value: float) -> bytes:
        registry = CollectorRegistry()
        Counter("ferry_requests", "requests", registry=registry).inc(value)
        return generate_latest(registry)

    asked: list[object] = []

    class Redis:
        async def mget(self, keys: object) -> list[bytes]:
            asked.append(keys)
            return [exposition(2)]

    sharing = Sharing(Redis(), SharingConfig(), make_cluster("a"), None, None, None, name="p")  # type: ignore[arg-type]
    sharing._members = ["p", "q"]
    own = exposition(1)
    merged = asyncio.run(sharing.merged_metrics(own))
    assert len(asked) == 1 and b"ferry_requests_total 3.0" in merged
    sharing._failing = True
    assert asyncio.run(sharing.merged_metrics(own)) == merged and len(asked) == 1


def test_a_shorter_interval_from_a_reload_starts_at_once() -> None:
    """A reload from a long interval to a short one waited out the long one
    (rebalancing held off for up to 10 minutes): the new interval starts now."""
    import asyncio

    async def run() -> int:
        cluster = make_cluster()
        rescheduler = Rescheduler(
            cluster,
            Migrator(cluster, {}),
            MigrationSettings(),
            interval_s=600.0,  # type: ignore[arg-type]
        )
        ticks = 0

        def tick() -> None:
            nonlocal ticks
            ticks += 1

        rescheduler.tick = tick  # type: ignore[method-assign]
        rescheduler.start()
        await asyncio.sleep(0.05)
        rescheduler.retune(MigrationSettings(), 0.01)
        await asyncio.sleep(0.2)
        await rescheduler.stop()
        return ticks

    assert asyncio.run(run()) >= 5


def test_full_instances_without_their_shim_are_planned_as_lite_ones_are() -> None:
    """`migration: full` moves by recompute where the instance's shim is not
    there (the README's fallback); the planner weighed no recompute for an
    all-`full` fleet all the same, so its moves stalled every stream they met."""
    configs = tuple(InstanceConfig(n, f"http://{n}", migration="full") for n in "ab")
    cluster = Cluster(configs, UsageSettings(), unhealthy_after_failures=3)
    all_full = MigrationSettings(count_recompute=False)  # what the file alone says
    planner = Rescheduler(cluster, Migrator(cluster, {}), all_full, interval_s=1)  # type: ignore[arg-type]
    assert planner._settings_now(planner._view()).count_recompute  # no shim seen: lite moves
    cluster.instances["a"].shim = {"block_size": 16, "kv_addr": "127.0.0.1:1"}
    assert planner._settings_now(planner._view()).count_recompute  # b still moves by recompute
    cluster.instances["b"].shim = {"block_size": 16, "kv_addr": "127.0.0.1:2"}
    assert not planner._settings_now(planner._view()).count_recompute


def planned_full(names: str) -> list[tuple[Any, str | None, str, bool]]:
    """A running stream on busy `a` in a `migration: full` fleet of `names`,
    where a and b are up with their shims (the stub placement's movers)."""
    configs = tuple(InstanceConfig(n, f"http://{n}", migration="full") for n in names)
    cluster = Cluster(configs, UsageSettings(high_priority_headroom_blocks=0.0), 3)
    for n in "ab":
        cluster.record_models(n, [{"id": "m"}])
        cluster.record_scrape(n, snapshot(), now=0.0)
        cluster.instances[n].shim = {"block_size": 16, "kv_addr": f"127.0.0.1:{ord(n)}"}
    cluster.set_peer_load({"a": InstanceLoad(97, 6, 0, 0)})  # freeness 0.5: sheds load
    migrator = Migrator(cluster, {"a": [RequestLoad(1, 96, Priority.NORMAL, running=True)]})
    planner = Rescheduler(
        cluster,
        migrator,  # type: ignore[arg-type]
        MigrationSettings(count_recompute=False),
        interval_s=1,
    )
    planner.tick()
    return migrator.submitted


def test_an_instance_down_weighs_no_recompute_for_moves_between_the_others() -> None:
    """c is `full` and down (its shim never seen): the moves between a and b,
    whose KV moves along, were weighed as recompute, and none was made."""
    assert [m[1] for m in planned_full("ab")] == ["b"]
    assert [m[1] for m in planned_full("abc")] == ["b"]
