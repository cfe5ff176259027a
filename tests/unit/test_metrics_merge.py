"""Several processes' expositions merged into one /metrics (proxy/metrics_merge.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics_merge import merge


def process(requests: int, inflight: int, freeness: float, cpu: float, only: str = "") -> str:
    r = CollectorRegistry()
    done = Counter("ferry_requests", "d", ["instance"], registry=r)
    done.labels("i0").inc(requests)
    if only:
        done.labels(only).inc()
    Gauge("ferry_inflight_requests", "d", ["instance"], registry=r).labels("i0").set(inflight)
    Gauge("ferry_instance_freeness", "d", ["instance"], registry=r).labels("i0").set(freeness)
    kv = Gauge("ferry_instance_kv_usage_ratio", "d", ["instance", "source"], registry=r)
    kv.labels("i0", "ledger").set(inflight / 100)  # this process's requests' share
    kv.labels("i0", "engine").set(freeness / 100)  # the engine's own, as every process scrapes it
    Counter("process_cpu_seconds", "d", registry=r).inc(cpu)
    ttft = Histogram("ferry_ttft_seconds", "d", registry=r, buckets=(0.1, 1.0))
    for _ in range(requests):
        ttft.observe(0.05)
    return generate_latest(r).decode()


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_counters_and_histograms_sum_gauges_are_the_answering_process_s() -> None:
    merged = samples(merge(process(2, 1, 5.0, 7.0), [process(3, 4, 6.0, 9.0, only="i9")]))
    i0 = (("instance", "i0"),)
    assert merged[("ferry_requests_total", i0)] == 5
    assert merged[("ferry_requests_total", (("instance", "i9"),))] == 1  # a peer's alone
    assert merged[("ferry_ttft_seconds_count", ())] == 5
    assert merged[("ferry_ttft_seconds_bucket", (("le", "0.1"),))] == 5
    assert merged[("ferry_inflight_requests", i0)] == 5  # each counts its own streams
    assert merged[("ferry_instance_freeness", i0)] == 5.0  # one view: the answering one's
    kv = "ferry_instance_kv_usage_ratio"
    assert merged[(kv, (("instance", "i0"), ("source", "ledger")))] == 0.05  # 0.01 + 0.04
    assert merged[(kv, (("instance", "i0"), ("source", "engine")))] == 0.05  # the answering one's
    assert merged[("process_cpu_seconds_total", ())] == 7.0  # this process's CPU


def test_alone_it_is_its_own_exposition() -> None:
    own = process(2, 1, 5.0, 7.0)
    assert samples(merge(own, [])) == samples(own.encode())


def test_a_peer_page_that_does_not_parse_is_left_out() -> None:
    """Another writer's data in a peer's key made every scrape a 500."""
    own, peer = process(2, 1, 5.0, 7.0), process(3, 4, 6.0, 9.0)
    merged = samples(merge(own, ["ferry_requests_total{instance=} not a number\n", peer]))
    assert merged[("ferry_requests_total", (("instance", "i0"),))] == 5  # own and the good peer
