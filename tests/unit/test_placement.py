"""Where a moved or rescued stream goes (proxy/placement.py), over a real Cluster."""

from __future__ import annotations

import random

from adapters import EngineSnapshot
from proxy.cluster import Cluster
from proxy.config import InstanceConfig
from proxy.metrics import FerryMetrics
from proxy.placement import Placement
from proxy.policy import Priority, UsageSettings, make_policy


def placement(*names: str) -> Placement:
    cluster = Cluster(
        tuple(InstanceConfig(n, f"http://{n}", migration="lite") for n in names),
        UsageSettings(),
        unhealthy_after_failures=3,
    )
    for n in names:
        cluster.record_models(n, [{"id": "m"}])
        cluster.record_scrape(
            n,
            EngineSnapshot(0, 0, 0.0, kv_blocks_total=100, block_size=16, preemptions_total=0),
            now=0.0,
        )
    return Placement(cluster, make_policy("llumnix"), FerryMetrics(), random.Random(0))


def rescue(p: Placement, source: str, *, rescue: bool = True) -> str | None:
    return p.destination("m", 64, Priority.NORMAL, {source}, rescue=rescue)


def test_a_rescue_takes_a_draining_instance_only_where_none_else_is_left() -> None:
    p = placement("a", "b", "c")
    p.cluster.set_draining("b", True)
    assert rescue(p, "a") == "c"  # a usable one first
    p.cluster.set_draining("c", True)
    assert rescue(p, "a", rescue=False) is None  # a move never does
    for _ in range(3):  # c has a stream already: b, the one with fewer
        p.cluster.ledger.add("c", "m", Priority.NORMAL, 64, now=0.0)
    assert rescue(p, "a") == "b"


def test_a_rescue_skips_instances_leaving_unhealthy_or_serving_another_model() -> None:
    p = placement("a", "b")
    p.cluster.set_draining("b", True)
    p.cluster.instances["b"].leaving = True  # removed once empty: may be gone first
    assert rescue(p, "a") is None
    p.cluster.instances["b"].leaving = False
    p.cluster.record_scrape_failure("b", "down")
    p.cluster.record_scrape_failure("b", "down")
    p.cluster.record_scrape_failure("b", "down")
    assert rescue(p, "a") is None
    q = placement("a", "b")
    q.cluster.set_draining("b", True)
    assert rescue(q, "a") == "b"
    q.cluster.record_models("b", [{"id": "other"}])
    assert rescue(q, "a") is None  # b serves another model
