"""Ferry's own Prometheus metrics (`ferry_` prefix), on a registry of its own.

Latencies are as the client sees them: time to first token from the moment the
request reached Ferry, inter-token latency between two relayed token chunks, and
the whole request (`ferry_request_duration_seconds`). They carry `model` and
`instance` labels: TTFT and ITL the instance that produced the token, the duration
and the token counters the instance that finished the request. Cardinality stays
bounded: `model` is a model one of the instances serves, else "other" (or "none"
for a request that names none), and `instance` is a configured instance
(a removed one's series go with it: `forget`).
Per-instance gauges are refreshed from the cluster view at each `/metrics` read,
and so is the scaling signal (`ferry_desired_instances`, proxy/policy/scaling.py).
Freeness is always finite: a draining instance (freeness -inf to the scheduler)
exports the freeness it would have without the drain, and `ferry_instance_draining`
says it drains; an unhealthy instance's freeness and engine KV usage are NaN (its
last look's figures are not its load). The process, GC and platform collectors
run on Ferry's registry.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from proxy.cluster import Cluster
from proxy.policy.scaling import ScalingSettings, scaling_signal
from proxy.policy.virtual_usage import instance_freeness
from proxy.ttft_stages import STAGES

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)
# A whole request: a short completion to a long generation of many minutes.
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# proxy/live_stream.py and proxy/migrator.py: why a stream moved, how the cut-over went.
MIGRATION_REASONS = ("failover", "rescue", "drain", "rebalance", "priority")
MIGRATION_OUTCOMES = (
    "ok",
    "no_destination",
    "destination_failed",
    "no_prompt_ids",
    "not_migratable",
)
# proxy/relay.py: the outcomes of a call that count against its instance (outlier
# ejection); a client's own 4xx and a client hanging up never do.
INSTANCE_FAILURES = ("connect_error", "upstream_error", "upstream_5xx", "stream_broken")
# TTFT stages: parsing and dispatch take microseconds, the engine's part seconds.
_STAGE_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4) + _LATENCY_BUCKETS
_DECISION_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2)


class LoopHistogram:
    """A labelled histogram for the per-token path, exported like any other.

    prometheus_client's takes a lock for each bucket and sum it updates and walks
    its buckets in Python: 1.5-4 us an observation, paid on every relayed token.
    Ferry observes from its one event-loop thread (and renders /metrics there),
    so this one needs no lock: a bisect and two additions."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...],
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self.bounds = (*buckets, math.inf)
        self._series: dict[tuple[str, ...], _Series] = {}
        registry.register(self)

    def labels(self, *values: str) -> _Series:
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}")
            series = self._series[values] = _Series(self.bounds)
        return series

    def forget(self, label: str, value: str) -> None:
        """Drop the series whose `label` is `value`."""
        at = self.labelnames.index(label)
        for values in [v for v in self._series if v[at] == value]:
            del self._series[values]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in self._series.items():
            buckets, total = [], 0
            for bound, count in zip(self.bounds, series.counts, strict=True):
                total += count
                buckets.append((floatToGoString(bound), total))
            family.add_metric(list(values), buckets, series.sum)
        yield family


class _Series:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.sum += value


class FerryMetrics:
    def __init__(self, scaling: ScalingSettings | None = None) -> None:
        # The scaling rule's thresholds; a reload may swap them (a frozen value).
        self.scaling = ScalingSettings() if scaling is None else scaling
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._sharing: Callable[[], tuple[bool, bool, int]] | None = None
        # The process's CPU, memory and file descriptors, and Python's GC: what one
        # event loop on one core runs out of first.
        for collector in (PROCESS_COLLECTOR, GC_COLLECTOR, PLATFORM_COLLECTOR):
            r.register(collector)
        self.requests = Counter(
            "ferry_requests",
            "Requests relayed, by instance and outcome.",
            ["instance", "outcome"],
            registry=r,
        )
        self.responses = Counter(
            "ferry_responses",
            "Answers to clients by HTTP status (499: the client left first), Ferry's own"
            " refusals included (no instance, an unknown model, a bad body); health checks"
            " and scrapes left out.",
            ["code"],
            registry=r,
        )
        self._responses: dict[int, Counter] = {}  # status -> its child, made once
        # Histograms observed for every request or token are LoopHistograms: an
        # observation with labels costs 0.5 us against prometheus_client's 3.8 us,
        # about 14 us a request over these four (of ~0.9 ms a request in all).
        self.ttft = LoopHistogram(
            "ferry_time_to_first_token_seconds",
            "Time to first token as the client sees it, by model and the instance that"
            " produced it.",
            ("model", "instance"),
            _LATENCY_BUCKETS,
            r,
        )
        ttft_stage = LoopHistogram(
            "ferry_time_to_first_token_stage_seconds",
            "Time to first token by stage, arrival to the first token written to the client:"
            " parse, dispatch, upstream_connect, upstream_first_byte, relay"
            " (see proxy/ttft_stages.py).",
            ("stage",),
            _STAGE_BUCKETS,
            r,
        )
        # One child per stage, made once: every series exists from the start.
        self.ttft_stage = {stage: ttft_stage.labels(stage) for stage in STAGES}
        self.itl = LoopHistogram(
            "ferry_inter_token_latency_seconds",
            "Gap between two token chunks relayed, by model and the instance that produced"
            " the later one.",
            ("model", "instance"),
            _LATENCY_BUCKETS,
            r,
        )
        self.duration = LoopHistogram(
            "ferry_request_duration_seconds",
            "Whole request as the client sees it (arrival to last byte), by model and the"
            " instance that finished it.",
            ("model", "instance"),
            _DURATION_BUCKETS,
            r,
        )
        self.prompt_tokens = Counter(
            "ferry_prompt_tokens",
            "Prompt tokens of finished requests (the engine's count where it reports one),"
            " by model and the instance that finished them.",
            ["model", "instance"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "ferry_generation_tokens",
            "Tokens generated for clients (a moved request's once, as the client got"
            " them), by model and the instance that finished the request.",
            ["model", "instance"],
            registry=r,
        )
        self.decision = LoopHistogram(
            "ferry_dispatch_decision_seconds",
            "Time to choose an instance for one request.",
            (),
            _DECISION_BUCKETS,
            r,
        ).labels()
        self.scrape_errors = Counter(
            "ferry_scrape_errors",
            "Failed metric scrapes by instance.",
            ["instance"],
            registry=r,
        )
        self.inflight = Gauge(
            "ferry_inflight_requests",
            "Requests this process has in flight, by instance.",
            ["instance"],
            registry=r,
        )
        self.freeness = Gauge(
            "ferry_instance_freeness",
            "Llumnix freeness (KV blocks per request); a draining instance shows the"
            " freeness it would have without the drain.",
            ["instance"],
            registry=r,
        )
        self.kv_usage = Gauge(
            "ferry_instance_kv_usage_ratio",
            "KV cache in use as a share of the cache: source=engine as the engine's"
            " last scrape says (0..1), source=ledger Ferry's own requests' blocks as"
            " its ledger counts them, queued ones included (past 1 when requests wait).",
            ["instance", "source"],
            registry=r,
        )
        self.healthy = Gauge(
            "ferry_instance_healthy",
            "1 if the instance takes traffic.",
            ["instance"],
            registry=r,
        )
        self.draining = Gauge(
            "ferry_instance_draining",
            "1 if the instance is draining.",
            ["instance"],
            registry=r,
        )
        self.migrations = Counter(
            "ferry_migrations",
            "Attempts to move running requests to another instance (lite or full), by reason"
            " and outcome.",
            ["reason", "outcome"],
            registry=r,
        )
        # Every reason and outcome exists from the start at 0, so a dashboard's
        # increase() sees the first one (a series born at 1 shows no increase).
        for reason in MIGRATION_REASONS:
            for outcome in MIGRATION_OUTCOMES:
                self.migrations.labels(reason, outcome)
        self.migration_downtime = Histogram(
            "ferry_migration_downtime_seconds",
            "Gap in the client's stream at a cut-over: last token before to first after.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_migrations = Counter(
            "ferry_kv_migrations",
            "Full-mode attempts (KV moved by migration_shim), by reason and outcome.",
            ["reason", "outcome"],
            registry=r,
        )
        self.kv_migrated_blocks = Counter(
            "ferry_kv_migrated_blocks",
            "KV blocks full-mode migrations moved instead of recomputing.",
            registry=r,
        )
        self.kv_precopy_stages = Counter(
            "ferry_kv_precopy_stages",
            "Pre-copy stages of successful full-mode migrations (before the stop-and-copy).",
            registry=r,
        )
        self.prefix_blocks = Gauge(
            "ferry_prefix_index_blocks",
            "KV blocks the prefix index places on the instance (its engine's, where"
            " followed through KV events; else Ferry's own record). Set while a policy"
            " reads the index.",
            ["instance"],
            registry=r,
        )
        self.prefix_precise = Gauge(
            "ferry_prefix_index_precise",
            "1 while the prefix index follows the instance's KV events (caught up), 0"
            " while it is approximate.",
            ["instance"],
            registry=r,
        )
        self.non_migratable = Counter(
            "ferry_non_migratable_requests",
            "Streams on migration-enabled instances that cannot move exactly, by reason.",
            ["reason"],
            registry=r,
        )
        self.ejected = Gauge(
            "ferry_instance_ejected",
            "1 while the instance is ejected after consecutive failed calls.",
            ["instance"],
            registry=r,
        )
        self.ejections = Counter(
            "ferry_ejections",
            "Times an instance was ejected after consecutive failed calls.",
            ["instance"],
            registry=r,
        )
        self.retries = Counter(
            "ferry_retries",
            "Requests sent again to another instance before the first byte, by why.",
            ["reason"],
            registry=r,
        )
        self.moves_planned = Counter(
            "ferry_rescheduler_moves_planned",
            "Moves the rescheduler planned and submitted, by kind of request (queued or running).",
            ["kind"],
            registry=r,
        )
        for kind in ("queued", "running"):  # both series exist from the start
            self.moves_planned.labels(kind)
        self.rescheduler_ticks = Counter(
            "ferry_rescheduler_ticks",
            "Rescheduler ticks (one plan each).",
            registry=r,
        )
        self.scrape_age = Gauge(
            "ferry_scrape_age_seconds",
            "Age of the last good scrape.",
            ["instance"],
            registry=r,
        )
        self.desired_instances = Gauge(
            "ferry_desired_instances",
            "Instances the scaling rule wants (Llumnix: average freeness kept between"
            " scale_out_freeness_below and scale_in_freeness_above); for KEDA/HPA.",
            registry=r,
        )
        self.average_freeness = Gauge(
            "ferry_average_freeness",
            "Average freeness of the serving instances, pooled (KV blocks per request);"
            " NaN when none is measurable.",
            registry=r,
        )

    def forget(self, instance: str) -> None:
        """Drop a removed instance's series, its counters and histograms too.
        Under discovery pods come and go (a rolling deploy renames every one),
        and each name kept some sixty series for the process's life; what they
        counted is Prometheus's to keep (a series that ends is no reset)."""
        labelled = (
            self.inflight,
            self.freeness,
            self.healthy,
            self.draining,
            self.ejected,
            self.scrape_age,
            self.kv_usage,
            self.requests,
            self.prompt_tokens,
            self.generation_tokens,
            self.scrape_errors,
            self.ejections,
            self.prefix_blocks,
            self.prefix_precise,
        )
        for metric in labelled:
            metric.remove_by_labels({"instance": instance})
        for histogram in (self.ttft, self.itl, self.duration):
            histogram.forget("instance", instance)

    def share(self, state: Callable[[], tuple[bool, bool, int]]) -> None:
        """With a shared view (proxy/sharing.py): `state()` says, at each scrape,
        whether Redis answers, whether this process holds the rescheduler lease,
        and how many peers it reads. Alone, these series are absent."""
        self._sharing = state
        r = self.registry
        self.sharing_redis_up = Gauge(
            "ferry_sharing_redis_up", "1 while this process reaches Redis.", registry=r
        )
        self.sharing_lease_held = Gauge(
            "ferry_sharing_lease_held",
            "1 while this process holds the rescheduler lease (one process should).",
            registry=r,
        )
        self.sharing_peers = Gauge(
            "ferry_sharing_peers", "The other processes whose load this one reads.", registry=r
        )

    def answered(self, status: int) -> None:
        """Count an answer to a client (`ferry_responses_total`)."""
        child = self._responses.get(status)
        if child is None:
            child = self._responses[status] = self.responses.labels(str(status))
        child.inc()

    def model_label(self, model: str | None, served: frozenset[str]) -> str:
        """The `model` label: bounded by the models the instances serve."""
        if not model:
            return "none"
        return model if model in served else "other"

    def render(self, cluster: Cluster, now: float | None = None) -> bytes:
        return self.prepare(cluster, now)()

    def prepare(self, cluster: Cluster, now: float | None = None) -> Callable[[], bytes]:
        """Set the gauges from `cluster` (on the event loop: it reads the loop's
        state) and return what renders the text, which may run in a thread."""
        now = time.monotonic() if now is None else now
        for view in cluster.view().instances:
            state = cluster.instances[view.name]
            # This process's own (a shared view's inflight counts its peers' too,
            # so summing the gauge over processes would count them again).
            self.inflight.labels(view.name).set(cluster.ledger.count(view.name))
            freeness = view.freeness
            if view.draining:  # -inf to the scheduler; the load it carries to a dashboard
                freeness = instance_freeness(view.capacity_blocks, view.virtual_blocks, view.batch)
            if not state.healthy:  # its last look is no load it carries now: no value
                freeness = math.nan
            self.freeness.labels(view.name).set(freeness)
            if state.snapshot is not None:
                usage = view.kv_usage if state.healthy else math.nan
                self.kv_usage.labels(view.name, "engine").set(usage)
            if view.capacity_blocks > 0:
                ledger = cluster.ledger.blocks(view.name) / view.capacity_blocks
                self.kv_usage.labels(view.name, "ledger").set(ledger)
            self.healthy.labels(view.name).set(1 if view.healthy else 0)
            self.draining.labels(view.name).set(1 if view.draining else 0)
            self.ejected.labels(view.name).set(1 if cluster.ejected_for(view.name) else 0)
            self.ejections.labels(view.name)  # at 0 until the first (see the migrations)
            for outcome in INSTANCE_FAILURES:  # (the dashboard's failed calls, the same way)
                self.requests.labels(view.name, outcome)
            prefixes = cluster.prefixes
            if prefixes.enabled:
                self.prefix_blocks.labels(view.name).set(prefixes.blocks(view.name))
                precise = prefixes.mode(view.name) == "precise"
                self.prefix_precise.labels(view.name).set(1 if precise else 0)
            age = now - state.snapshot_at if state.snapshot_at is not None else float("inf")
            self.scrape_age.labels(view.name).set(age)
        if self._sharing is not None:
            up, lease, peers = self._sharing()
            self.sharing_redis_up.set(1 if up else 0)
            self.sharing_lease_held.set(1 if lease else 0)
            self.sharing_peers.set(peers)
        signal = scaling_signal(cluster.view(), self.scaling)
        self.desired_instances.set(signal.desired)
        self.average_freeness.set(math.nan if signal.freeness is None else signal.freeness)
        return self.text

    def text(self) -> bytes:
        """The exposition as the metrics stand (prometheus_client locks each one)."""
        return generate_latest(self.registry)
