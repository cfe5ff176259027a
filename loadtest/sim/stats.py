"""Summaries of a simulated (or replayed) run: latency percentiles, SLOs, costs.

Decode latency is per request: (finish - first token) / (tokens - 1), the mean
time per output token after the first, as in the Llumnix paper. A stream's
stall is its worst gap between two tokens (a preemption or a move shows here,
however short the rest of its gaps); `stall_p99` is the P99 over streams.
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


def lower(ratio: float) -> str:
    """A ratio of theirs over ours, said the way round it goes (0.5 is "2.0x higher")."""
    if ratio >= 1 or ratio <= 0:
        return f"{ratio:.1f}x lower"
    return f"{1 / ratio:.1f}x higher"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


def latencies(requests: Sequence[SimRequest], slo: Slo) -> dict[str, Any]:
    timed = [t for t in map(request_times, requests) if t is not None]
    ttft = [t[0] for t in timed]
    decode = [t[1] for t in timed if t[1] is not None]
    stalls = [r.worst_gap for r in requests if r.finish is not None and r.generated > 1]
    met = sum(
        1
        for ttft_s, decode_s, _ in timed
        if ttft_s <= slo.ttft_s and (decode_s is None or decode_s <= slo.decode_s)
    )
    return {
        "requests": len(requests),
        "finished": len(timed),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "decode_p50": percentile(decode, 50),
        "decode_p99": percentile(decode, 99),
        "e2e_p99": percentile([t[2] for t in timed], 99),
        "stall_p50": percentile(stalls, 50),
        "stall_p99": percentile(stalls, 99),
        "slo_attainment": met / len(requests) if requests else float("nan"),
        "preemptions": sum(r.preemptions for r in requests),
        "migrations": sum(r.migrations for r in requests),
    }


def request_times(r: SimRequest) -> tuple[float, float | None, float] | None:
    """(TTFT, decode time per token or None for one-token requests, end to end)."""
    if r.finish is None or r.first_token is None:
        return None
    decode = (r.finish - r.first_token) / (r.generated - 1) if r.generated > 1 else None
    return r.first_token - r.arrival, decode, r.finish - r.arrival


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
