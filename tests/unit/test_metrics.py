"""Ferry's /metrics text: the scaling signal for an autoscaler."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from adapters import EngineSnapshot
from proxy.cluster import Cluster
from proxy.config import InstanceConfig
from proxy.metrics import FerryMetrics
from proxy.policy import UsageSettings
from proxy.policy.scaling import ScalingSettings


def cluster_of(*loads: tuple[int, float]) -> Cluster:
    """Instances of 100 KV blocks, each with (running requests, KV usage) scraped."""
    names = [f"i{n}" for n in range(len(loads))]
    cluster = Cluster(tuple(InstanceConfig(n, f"http://{n}") for n in names), UsageSettings(), 3)
    for name, (running, usage) in zip(names, loads, strict=True):
        cluster.record_models(name, [{"id": "m"}])
        snap = EngineSnapshot(
            running, 0, usage, kv_blocks_total=100, block_size=16, preemptions_total=0
        )
        cluster.record_scrape(name, snap, now=0.0)
    return cluster


def gauges(metrics: FerryMetrics, cluster: Cluster) -> dict[str, float]:
    text = metrics.render(cluster, now=0.0).decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in ("ferry_desired_instances", "ferry_average_freeness")
    }


def test_a_full_cluster_asks_for_more_instances() -> None:
    # (200 - 190) / 8 = 1.25 blocks per request < 10: 70 blocks short, one instance.
    values = gauges(FerryMetrics(), cluster_of((4, 0.95), (4, 0.95)))
    assert values == {"ferry_desired_instances": 3.0, "ferry_average_freeness": 1.25}


def test_an_idle_cluster_asks_for_fewer_down_to_the_minimum() -> None:
    idle = cluster_of((0, 0.0), (0, 0.0), (0, 0.0))
    assert gauges(FerryMetrics(), idle)["ferry_desired_instances"] == 2.0
    kept = FerryMetrics(ScalingSettings(min_instances=3))
    assert gauges(kept, idle)["ferry_desired_instances"] == 3.0
