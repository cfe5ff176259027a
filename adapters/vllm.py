"""vLLM adapter: Prometheus `/metrics` text -> `EngineSnapshot`.

Metric names are data: each field lists the names vLLM has used for it, newest
first, so one parser reads 0.6 through 0.32. Every series carries an `engine`
label (one per data-parallel engine); counts are summed over engines, the KV
usage fraction is weighted by each engine's block count.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from urllib.parse import urlencode

from prometheus_client.parser import text_string_to_metric_families

from adapters import vllm_kv_events
from adapters.engine import EngineAdapter
from adapters.snapshot import EngineSnapshot, MetricsParseError

METRICS_PATH = "/metrics"

# Field -> sample names, newest first. `gpu_*` names were renamed in 0.9.2 and
# removed in 0.12; V0 exposed counters without the `_total` suffix.
METRIC_NAMES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
}
CACHE_INFO = "vllm:cache_config_info"
BLOCK_COUNT_LABELS = ("num_gpu_blocks", "num_cpu_blocks")

# The series above asked for by name: prometheus_client's `name[]` filter, which
# vLLM serves under its `/metrics/` mount (the `/metrics` route itself renders
# everything). Measured on vLLM 0.32 CPU (`python -m loadtest.scrape_cost`):
# 1.9 KB and 0.5 ms of the server's CPU a scrape, against 52 KB and 3.8 ms, on
# the core its engine uses, four times a second.
METRICS_NARROW_PATH = "/metrics/?" + urlencode(
    [("name[]", name) for names in METRIC_NAMES.values() for name in names]
    + [("name[]", CACHE_INFO)]
)

# Fields the proxy adds to a request so the engine reports token ids; the relay
# strips the matching response fields unless the client asked for them itself.
TOKEN_ID_REQUEST_FIELDS = {"return_token_ids": True}


def parse_metrics(text: str) -> EngineSnapshot:
    """Parse one scrape of a vLLM server's `/metrics`.

    Raises MetricsParseError when the text is not Prometheus exposition or carries
    none of the vLLM load gauges (for example a different server on that port).
    """
    # engine -> field -> rank of the name it came under -> summed value
    seen: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    blocks: dict[str, int] = {}
    block_size = 0
    load_lines: list[str] = []
    try:
        for line in text.split("\n"):
            if line.startswith(CACHE_INFO):
                engine, block_size, blocks[engine] = _cache_info(line)
            elif line.startswith(_LOAD_PREFIXES):
                load_lines.append(line)
        for family in text_string_to_metric_families("\n".join(load_lines) + "\n"):
            for sample in family.samples:
                if sample.name in _FIELD_BY_NAME:  # a prefix match may be a longer name
                    # Prometheus text allows NaN and +Inf; load is neither, nor below 0.
                    if not 0 <= sample.value < math.inf:
                        raise MetricsParseError(f"{sample.name} is {sample.value}")
                    field, rank = _FIELD_BY_NAME[sample.name]
                    by_rank = seen[sample.labels.get("engine", "0")][field]
                    by_rank[rank] = by_rank.get(rank, 0.0) + sample.value
    except MetricsParseError:
        raise
    except (ValueError, TypeError, IndexError, OverflowError) as exc:
        raise MetricsParseError(f"not Prometheus text: {exc}") from exc
    # During a rename an engine exports both names; the newest (lowest rank) wins.
    per_engine = {
        engine: {field: by_rank[min(by_rank)] for field, by_rank in fields.items()}
        for engine, fields in seen.items()
    }
    engines = [e for e, fields in per_engine.items() if "running" in fields]
    if not engines:
        raise MetricsParseError("no vllm:num_requests_running series: is this a vLLM server?")

    def total(field: str) -> float:
        return sum(per_engine[e].get(field, 0.0) for e in engines)

    total_blocks = sum(blocks.get(e, 0) for e in engines)
    if total_blocks:
        used = sum(per_engine[e].get("kv_usage", 0.0) * blocks.get(e, 0) for e in engines)
        kv_usage = used / total_blocks
    else:
        kv_usage = total("kv_usage") / len(engines)
    try:
        return EngineSnapshot(
            running=int(total("running")),
            waiting=int(total("waiting")),
            kv_usage=min(max(kv_usage, 0.0), 1.0),
            kv_blocks_total=total_blocks,
            block_size=block_size,
            preemptions_total=int(total("preemptions")),
            engines=len(engines),
        )
    except (OverflowError, ValueError) as exc:  # finite gauges whose sum is not (1e308 x 2)
        raise MetricsParseError(f"load out of range: {exc}") from exc


@functools.lru_cache(maxsize=64)
def _cache_info(line: str) -> tuple[str, int, int]:
    """(engine, block size, block count) from one `cache_config_info` line.

    The line carries ~40 labels and never changes for a running engine; parsing
    it costs ~0.4 ms, so it is parsed once and remembered.
    """
    (family,) = text_string_to_metric_families(line + "\n")
    labels = family.samples[0].labels
    return (
        labels.get("engine", "0"),
        int(float(labels.get("block_size") or 0)),
        _block_count(labels),
    )


def _block_count(labels: dict[str, str]) -> int:
    for label in BLOCK_COUNT_LABELS:
        value = labels.get(label, "")
        if value not in ("", "None"):
            return int(float(value))
    return 0


_FIELD_BY_NAME = {
    name: (field, rank) for field, names in METRIC_NAMES.items() for rank, name in enumerate(names)
}
# Sample lines of interest start with one of these; histogram lines are skipped
# without parsing (a vLLM scrape is ~600 lines, mostly histogram buckets).
_LOAD_PREFIXES = tuple(_FIELD_BY_NAME)


ADAPTER = EngineAdapter(
    name="vllm",
    metrics_path=METRICS_PATH,
    metrics_narrow_path=METRICS_NARROW_PATH,
    parse_metrics=parse_metrics,
    token_id_request_fields=TOKEN_ID_REQUEST_FIELDS,
    returns_token_ids=True,
    runs_shim=True,
    kv_events=vllm_kv_events.FORMAT,
    # Read under `--scheduling-policy priority`; any other policy refuses a
    # request that sets it to anything but 0.
    priority_field="priority",
)
