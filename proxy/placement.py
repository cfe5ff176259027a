"""Placement: the policy core's decision over the live view, timed and counted.

The relay places new requests with `choose`; the migrator places moved and
resumed streams with `destination`, among the instances that can take a move.
"""

from __future__ import annotations

import random
import time

from proxy.cluster import Cluster
from proxy.metrics import FerryMetrics
from proxy.policy import DispatchRequest, InstanceView, NoCandidate, Priority, dispatch
from proxy.policy.policies import DispatchPolicy


class Placement:
    def __init__(
        self,
        cluster: Cluster,
        policy: DispatchPolicy,
        metrics: FerryMetrics,
        rng: random.Random,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self.metrics = metrics
        self.rng = rng

    def choose(self, request: DispatchRequest) -> InstanceView:
        """The instance for `request`; raises `NoCandidate`."""
        started = time.perf_counter()
        chosen = dispatch(self.policy, request, self.cluster.view(), self.rng)
        self.cluster.note_dispatch()
        self.metrics.decision.observe(time.perf_counter() - started)
        return chosen

    def migration_instances(self) -> set[str]:
        """Instances that can take part in a move (as source or destination)."""
        return {
            name
            for name, state in self.cluster.instances.items()
            if state.config.migration != "off" and state.healthy and not state.draining
        }

    def destination(
        self,
        model: str,
        tokens: int,
        priority: Priority,
        exclude: set[str],
        preferred: str | None = None,
    ) -> str | None:
        """Where a stream of `tokens` (prompt + generated) should go on: `preferred`
        if it can take it, else the policy's pick among migration instances."""
        usable = self.migration_instances()
        if preferred and preferred in usable and preferred not in exclude:
            return preferred
        skip = frozenset(exclude | (set(self.cluster.instances) - usable))
        try:
            return self.choose(DispatchRequest(model, tokens, priority, skip)).name
        except NoCandidate:
            return None
