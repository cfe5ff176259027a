"""The scaling signal: how many instances the cluster wants (Llumnix, OSDI '24, 4.4.4).

Llumnix keeps the cluster's average freeness inside a band: below the band it
adds instances, above it it drains one (by migration) and removes it. Here the
rule yields a desired instance count for an external autoscaler (KEDA, HPA) to
read; Ferry starts and stops nothing itself.

Average freeness pools the serving instances as if they were one instance:

    F = (sum M - sum V) / max(sum B, 1)        KV blocks per request

over the dispatchable instances whose capacity M is known (V: their virtual
usage, B: their batch). Pooling, rather than a mean of per-instance freeness,
keeps one idle instance (F = M, say 1000) from hiding three full ones; it is
what Llumnix's `avg_load` scaling policy computes. An instance whose engine does
not publish its cache size (freeness -B there) gives no memory signal: it counts
in the fleet, not in F. Draining instances are leaving: they count in neither.

    fleet   = instances not draining, healthy or not (an unhealthy one is starting,
              or about to be restarted: it is one of the autoscaler's replicas)
    pending = fleet instances not dispatchable yet; each counts in F as an empty
              instance of its last known capacity (else the mean M of the rest),
              so instances already starting are not asked for twice
    F < scale_out_freeness_below:
              desired = fleet + k, k >= 1 the fewest empty instances of the mean
              capacity that lift F back to the threshold (requests staying put):
              k = ceil((below * max(sum B, 1) - (sum M - sum V)) / mean M)
    F without one instance of mean capacity > scale_in_freeness_above, and no
    instance pending:
              desired = fleet - 1 (the autoscaler removes one; it drains by migration)
    otherwise desired = fleet
    then clamped to [min_instances, max_instances].

Scale-in asks for the freeness *after* the removal to stay above its threshold
(Llumnix's `avg_load` does the same), so a removal never drops F under the
scale-out threshold while the load holds (no flapping: out < in is required),
and one instance goes at a time, each drain observed before the next. With no
measurable instance (all unhealthy, or no capacity known) the fleet holds: an
outage is no reason to scale in.

Defaults are Llumnix's (`--scale-up-threshold 10`, `--scale-down-threshold 60`,
in its freeness units): with vLLM's 16-token blocks, F = 10 leaves each request
about 160 tokens of growth before the cluster's KV memory runs out (preemptions
are near), F = 60 about 960 (the cluster idles).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from proxy.policy.view import ClusterView


@dataclass(frozen=True, slots=True)
class ScalingSettings:
    scale_out_freeness_below: float = 10.0  # KV blocks per request
    scale_in_freeness_above: float = 60.0  # KV blocks per request, with one instance fewer
    min_instances: int = 1
    max_instances: int | None = None  # None: no cap (the autoscaler's own applies)

    def __post_init__(self) -> None:
        # Messages name the keys as the YAML spells them (under `scheduler.`).
        out, into = self.scale_out_freeness_below, self.scale_in_freeness_above
        if not (math.isfinite(out) and math.isfinite(into)):
            raise ValueError("scale_out_freeness_below, scale_in_freeness_above: must be finite")
        if out >= into:
            raise ValueError(
                "scale_out_freeness_below: must be below scale_in_freeness_above"
                f" (got {out:g} >= {into:g})"
            )
        # No scale to zero: with no instance there is no freeness to wake up on.
        if self.min_instances < 1:
            raise ValueError(f"min_instances: must be at least 1 (got {self.min_instances})")
        if self.max_instances is not None and self.max_instances < self.min_instances:
            raise ValueError(
                f"max_instances: must be at least min_instances ({self.min_instances}),"
                f" or null for no cap (got {self.max_instances})"
            )


@dataclass(frozen=True, slots=True)
class ScalingSignal:
    """One reading of the rule (see the module docstring)."""

    fleet: int  # instances not draining
    pending: int  # of those, not dispatchable yet
    freeness: float | None  # pooled average freeness, None when nothing is measurable
    desired: int


def scaling_signal(view: ClusterView, settings: ScalingSettings) -> ScalingSignal:
    """The instance count the scaling rule wants for `view`; O(instances)."""
    fleet = [v for v in view.instances if not v.draining]
    measured = [v for v in fleet if v.dispatchable and v.capacity_blocks > 0]
    pending = [v for v in fleet if not v.dispatchable]
    if not measured:
        return ScalingSignal(len(fleet), len(pending), None, _clamp(len(fleet), settings))
    mean_capacity = sum(v.capacity_blocks for v in measured) / len(measured)
    free = sum(v.capacity_blocks - v.virtual_blocks for v in measured)
    # Pending instances will serve soon: count them as empty capacity now.
    free += sum(v.capacity_blocks if v.capacity_blocks > 0 else mean_capacity for v in pending)
    batch = max(sum(v.batch for v in measured), 1)
    freeness = free / batch
    desired = len(fleet)
    if freeness < settings.scale_out_freeness_below:
        short = settings.scale_out_freeness_below * batch - free  # > 0 here
        desired += max(1, math.ceil(short / mean_capacity))
    elif not pending and (free - mean_capacity) / batch > settings.scale_in_freeness_above:
        desired -= 1
    return ScalingSignal(len(fleet), len(pending), freeness, _clamp(desired, settings))


def _clamp(n: int, settings: ScalingSettings) -> int:
    if settings.max_instances is not None:
        n = min(n, settings.max_instances)
    return max(n, settings.min_instances)
