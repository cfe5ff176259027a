"""Summaries of a simulated (or replayed) run: latency percentiles, SLOs, costs.

Decode latency is per request: (finish - first token) / (tokens - 1), the mean
time per output token after the first, as in the Llumnix paper.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.sim.instance import SimRequest
from proxy.policy import Priority

SLO_TTFT_S = 1.0
SLO_DECODE_S = 0.05


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = SLO_TTFT_S
    decode_s: float = SLO_DECODE_S


DEFAULT_SLO = Slo()


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


def latencies(requests: Sequence[SimRequest], slo: Slo) -> dict[str, Any]:
    done = [r for r in requests if r.finish is not None and r.first_token is not None]
    ttft = [r.first_token - r.arrival for r in done]  # type: ignore[operator]
    decode = [
        (r.finish - r.first_token) / (r.generated - 1)  # type: ignore[operator]
        for r in done
        if r.generated > 1
    ]
    e2e = [r.finish - r.arrival for r in done]  # type: ignore[operator]
    met = sum(
        1
        for r in done
        if r.first_token - r.arrival <= slo.ttft_s  # type: ignore[operator]
        and (r.generated <= 1 or (r.finish - r.first_token) / (r.generated - 1) <= slo.decode_s)  # type: ignore[operator]
    )
    return {
        "requests": len(requests),
        "finished": len(done),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "decode_p50": percentile(decode, 50),
        "decode_p99": percentile(decode, 99),
        "e2e_p99": percentile(e2e, 99),
        "slo_attainment": met / len(requests) if requests else float("nan"),
        "preemptions": sum(r.preemptions for r in requests),
        "migrations": sum(r.migrations for r in requests),
    }


def summarize(
    requests: Sequence[SimRequest], migrations: dict[str, int], slo: Slo = DEFAULT_SLO
) -> dict[str, Any]:
    out: dict[str, Any] = latencies(requests, slo)
    out["preemption_loss_s"] = round(sum(r.preempt_loss for r in requests), 3)
    out["migrations_aborted"] = migrations.get("aborted", 0)
    out["by_priority"] = {
        p.name.lower(): latencies([r for r in requests if r.klass is p], slo)
        for p in Priority
        if any(r.klass is p for r in requests)
    }
    return out
