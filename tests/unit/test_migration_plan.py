from __future__ import annotations

from proxy.policy import ClusterView, InstanceView, Priority, instance_freeness
from proxy.policy.migration import MigrationSettings, RequestLoad, plan_migrations, sources

BS = 16


def inst(name: str, capacity: int, virtual: float, batch: int, **kw: object) -> InstanceView:
    return InstanceView(  # type: ignore[arg-type]
        name=name,
        freeness=instance_freeness(capacity, virtual, batch),
        capacity_blocks=capacity,
        virtual_blocks=virtual,
        batch=batch,
        **kw,
    )


def plan(view: ClusterView, requests: dict[str, list[RequestLoad]], **settings: object) -> list:
    ms = MigrationSettings(**settings)  # type: ignore[arg-type]
    return plan_migrations(view, requests, {n: BS for n in requests}, ms)


def test_overloaded_source_sends_its_queued_request_first() -> None:
    hot = inst("hot", 100, 130, 6)  # demand beyond capacity: F < 0
    cold = inst("cold", 100, 10, 1)
    view = ClusterView((hot, cold))
    assert sources(view, MigrationSettings()) == ["hot"]
    reqs = [
        RequestLoad(1, 40, Priority.LOW, running=True),
        RequestLoad(2, 300, Priority.NORMAL, running=False),
        RequestLoad(3, 200, Priority.NORMAL, running=False),
    ]
    [move] = plan(view, {"hot": reqs})
    assert (move.request_id, move.source, move.destination) == (2, "hot", "cold")
    assert "queued" in move.reason


def test_running_requests_move_lowest_priority_then_shortest() -> None:
    view = ClusterView((inst("hot", 100, 130, 4), inst("cold", 100, 10, 1)))
    reqs = [
        RequestLoad(1, 40, Priority.NORMAL, running=True),
        RequestLoad(2, 900, Priority.LOW, running=True),
        RequestLoad(3, 100, Priority.LOW, running=True),
        RequestLoad(4, 10, Priority.HIGH, running=True),
    ]
    assert plan(view, {"hot": reqs})[0].request_id == 3
    assert plan(view, {"hot": reqs}, move_running=False) == []


def test_no_move_without_room_or_when_it_would_invert_the_imbalance() -> None:
    view = ClusterView((inst("hot", 100, 130, 4), inst("cold", 100, 90, 1)))
    big = [RequestLoad(1, 16 * 20, Priority.NORMAL, running=True)]
    assert plan(view, {"hot": big}) == []  # 21 blocks do not fit in the 10 left
    # Both tight: moving would leave the destination less free than the source.
    view = ClusterView((inst("a", 100, 101, 2), inst("b", 100, 80, 2)))
    assert plan(view, {"a": [RequestLoad(1, 16 * 15, Priority.NORMAL, running=True)]}) == []


def test_balanced_cluster_plans_nothing() -> None:
    view = ClusterView((inst("a", 100, 50, 5), inst("b", 100, 40, 4)))
    assert sources(view, MigrationSettings()) == []
    assert plan(view, {}) == []


def test_pairs_least_free_with_freest() -> None:
    view = ClusterView(
        (
            inst("hot1", 100, 120, 4),
            inst("hot2", 100, 150, 4),
            inst("cold1", 100, 0, 0),
            inst("cold2", 100, 30, 2),
        )
    )
    one = [RequestLoad(1, 30, Priority.NORMAL, running=False)]
    two = [RequestLoad(2, 30, Priority.NORMAL, running=False)]
    moves = plan(view, {"hot1": one, "hot2": two})
    assert {(m.source, m.destination) for m in moves} == {("hot2", "cold1"), ("hot1", "cold2")}
