"""Ferry's /metrics text: the scaling signal for an autoscaler, and the per-token
histogram that renders as prometheus_client's does."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from adapters import EngineSnapshot
from proxy.cluster import Cluster
from proxy.config import InstanceConfig
from proxy.metrics import FerryMetrics, LoopHistogram
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


def test_a_draining_instance_shows_a_finite_freeness() -> None:
    cluster = cluster_of((4, 0.5), (4, 0.5))
    cluster.set_draining("i0", True)
    text = FerryMetrics().render(cluster, now=0.0).decode()
    samples = {
        (s.name, s.labels.get("instance"), s.labels.get("source")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    # The scheduler sees -inf; the dashboard sees the load: (100 - 50 blocks used) / 4.
    freeness = samples["ferry_instance_freeness", "i0", None]
    assert freeness == samples["ferry_instance_freeness", "i1", None] == 12.5
    assert samples["ferry_instance_draining", "i0", None] == 1.0
    assert samples["ferry_instance_kv_usage_ratio", "i0", "engine"] == 0.5  # scraped
    assert samples["ferry_instance_kv_usage_ratio", "i0", "ledger"] == 0.0  # nothing of Ferry's
    assert ("process_cpu_seconds_total", None, None) in samples


def test_an_unhealthy_instance_shows_no_freeness_nor_engine_usage() -> None:
    """A dead engine's last look is no load it carries: a dashboard must not keep
    showing it as half full (or as the freest instance)."""
    cluster = cluster_of((4, 0.5), (4, 0.5))
    for _ in range(3):
        cluster.record_scrape_failure("i0", "connection refused")
    text = FerryMetrics().render(cluster, now=0.0).decode()
    samples = {
        (s.name, s.labels.get("instance"), s.labels.get("source")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert math.isnan(samples["ferry_instance_freeness", "i0", None])
    assert math.isnan(samples["ferry_instance_kv_usage_ratio", "i0", "engine"])
    assert samples["ferry_instance_healthy", "i0", None] == 0.0
    assert samples["ferry_instance_freeness", "i1", None] == 12.5


def test_the_model_label_is_bounded_by_the_models_served() -> None:
    metrics = FerryMetrics()
    served = frozenset({"m"})
    assert metrics.model_label("m", served) == "m"
    assert metrics.model_label("anything else", served) == "other"
    assert metrics.model_label(None, served) == "none"


def test_the_loop_histogram_renders_as_prometheus_clients() -> None:
    """Same observations, same exposition (less prometheus_client's `_created`)."""
    buckets = (0.001, 0.01, 0.1, 1.0)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = LoopHistogram("lat_seconds", "Latency.", ("model", "instance"), buckets, ours)
    reference = Histogram(
        "lat_seconds", "Latency.", ["model", "instance"], buckets=buckets, registry=theirs
    )
    values = [0.0005, 0.001, 0.0011, 0.05, 0.1, 0.5, 3.0, 0.01]
    for n, value in enumerate(values):
        instance = "a" if n % 3 else "b"
        fast.labels("m", instance).observe(value)
        reference.labels("m", instance).observe(value)
    ours_text = generate_latest(ours).decode().splitlines()
    theirs_text = [x for x in generate_latest(theirs).decode().splitlines() if "_created" not in x]
    assert sorted(ours_text) == sorted(theirs_text)
    assert 'lat_seconds_bucket{instance="a",le="0.001",model="m"} 1.0' in ours_text
