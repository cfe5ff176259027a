"""One `/metrics` for several processes: their expositions merged into one (pure).

With `--workers N` (or replicas behind one name) a scrape of the port reaches
one process; alone, its counters would jump between processes' values. Each
process publishes its exposition (proxy/sharing.py), and the one scraped merges
its own with its live peers':
- counters and histograms (every sample: totals, buckets, sums, counts) are
  summed, so rates are the cluster's;
- gauges are the answering process's own (every process has the same view of
  an instance's freeness, health or draining), except those that count this
  process's own work (`SUMMED_GAUGES`, and the samples of `SUMMED_SAMPLES`:
  the KV its own requests hold), which are summed;
- `process_*` and `python_*` (CPU, memory, GC) describe the answering process
  and are its own.
A sample only peers have is taken from them on the same rules. A peer that
restarts starts its counters at 0 again: to Prometheus, a counter reset.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

log = logging.getLogger("ferry.sharing")

SUMMED_GAUGES = frozenset({"ferry_inflight_requests"})
# Gauges summed for one label's value only: the ledger's KV share is each
# process's own requests', the engine's is the same scrape in every process.
SUMMED_SAMPLES = {"ferry_instance_kv_usage_ratio": ("source", "ledger")}
OWN_PREFIXES = ("process_", "python_")
_SUMMED_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram"})


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge(own: str, peers: Sequence[str]) -> bytes:
    """`own` exposition with `peers`' merged in (text format 0.0.4)."""
    families: dict[str, Metric] = {}
    for n, text in enumerate([own, *peers]):
        try:
            parsed = list(text_string_to_metric_families(text))
        except Exception:  # noqa: BLE001 - any parser fault, on a peer's page
            if not n:
                raise
            # Another writer's data in a peer's key: left out, not the scrape's 500.
            log.debug("a peer's metrics do not parse: left out")
            continue
        for family in parsed:
            known = families.get(family.name)
            if known is None:
                if n and family.name.startswith(OWN_PREFIXES):
                    continue  # a peer's process metrics: not this process's
                families[family.name] = family
            elif n and not family.name.startswith(OWN_PREFIXES):
                _merge_into(known, family)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


def _merge_into(known: Metric, peer: Metric) -> None:
    summed = known.type in _SUMMED_TYPES or known.name in SUMMED_GAUGES
    label, value = SUMMED_SAMPLES.get(known.name, ("", None))
    index = {_key(s): i for i, s in enumerate(known.samples)}
    for sample in peer.samples:
        i = index.get(_key(sample))
        if i is None:
            index[_key(sample)] = len(known.samples)
            known.samples.append(sample)
        elif summed or (value is not None and sample.labels.get(label) == value):
            mine = known.samples[i]
            known.samples[i] = mine._replace(value=mine.value + sample.value)


def _key(sample: Sample) -> tuple[str, tuple[tuple[str, str], ...]]:
    return sample.name, tuple(sorted(sample.labels.items()))
