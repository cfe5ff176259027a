"""Dispatch policies: Llumnix virtual usage and the baselines peers use.

Every policy has one signature, `choose(request, candidates, rng, seq)`, and sees
only candidates that the runner (`dispatch.dispatch`) already filtered to healthy,
non-draining instances serving the model. Ties are broken at random among the
best, so a burst between two scrapes does not pile onto the first name.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Protocol

from proxy.policy.view import DispatchRequest, InstanceView, Priority


class DispatchPolicy(Protocol):
    name: str

    def choose(
        self,
        request: DispatchRequest,
        candidates: Sequence[InstanceView],
        rng: random.Random,
        seq: int,
    ) -> InstanceView: ...


def best(
    candidates: Sequence[InstanceView], scores: list[float], rng: random.Random
) -> InstanceView:
    """The candidate with the highest score; ties at random.

    Scores come in as a list built by the caller's comprehension: at 256
    instances that is about twice as fast as calling a key function per item.
    """
    top = max(scores)
    if top == -math.inf:  # every candidate is draining-infinite: still answer
        return rng.choice(candidates)
    ties = [v for v, s in zip(candidates, scores, strict=True) if s == top]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


class Llumnix:
    """Freest instance by virtual usage: argmax F = (M - sum V) / B.

    High-priority requests rank instances by `freeness_high` (headroom reserved
    for their class not counted); the rest by `freeness`.

    Use it when requests differ in length: it balances KV memory per request,
    not request counts. `topk` > 1 picks at random among the k freest, which
    spreads a burst that arrives faster than the ledger can tell instances apart.
    """

    name = "llumnix"

    def __init__(self, topk: int = 1) -> None:
        self.topk = topk

    def choose(
        self,
        request: DispatchRequest,
        candidates: Sequence[InstanceView],
        rng: random.Random,
        seq: int,
    ) -> InstanceView:
        # A high-priority request does not count the headroom reserved for its class.
        if request.priority is Priority.HIGH:
            scores = [v.freeness_high for v in candidates]
        else:
            scores = [v.freeness for v in candidates]
        if self.topk <= 1 or len(candidates) <= 1:
            return best(candidates, scores, rng)
        ranked = sorted(zip(scores, range(len(candidates)), strict=True), reverse=True)
        return candidates[rng.choice(ranked[: self.topk])[1]]


class RoundRobin:
    """The n-th decision goes to candidate n mod N (by name order)."""

    name = "round_robin"

    def choose(
        self,
        request: DispatchRequest,
        candidates: Sequence[InstanceView],
        rng: random.Random,
        seq: int,
    ) -> InstanceView:
        return candidates[seq % len(candidates)]


class Random:
    """Uniformly at random."""

    name = "random"

    def choose(
        self,
        request: DispatchRequest,
        candidates: Sequence[InstanceView],
        rng: random.Random,
        seq: int,
    ) -> InstanceView:
        return rng.choice(candidates)


class LeastRequests:
    """Fewest requests in flight through this proxy (nginx `least_conn`)."""

    name = "least_requests"

    def choose(
        self,
        request: DispatchRequest,
        candidates: Sequence[InstanceView],
        rng: random.Random,
        seq: int,
    ) -> InstanceView:
        return best(candidates, [-v.inflight for v in candidates], rng)


class LeastKV:
    """Lowest scraped KV-cache usage (INFaaS; AIBrix `least-kv-cache`).

    Blind between scrapes by design: this is what scrape-only balancers do.
    """

    name = "least_kv"

    def choose(
        self,
        request: DispatchRequest,
        candidates: Sequence[InstanceView],
        rng: random.Random,
        seq: int,
    ) -> InstanceView:
        return best(candidates, [-v.kv_usage for v in candidates], rng)


class PowerOfTwo:
    """Two candidates at random, the one with fewer requests in flight."""

    name = "power_of_two"

    def choose(
        self,
        request: DispatchRequest,
        candidates: Sequence[InstanceView],
        rng: random.Random,
        seq: int,
    ) -> InstanceView:
        sample = candidates if len(candidates) <= 2 else rng.sample(candidates, 2)
        return best(sample, [-v.inflight for v in sample], rng)


class QueueKVScorer:
    """llm-d's default endpoint picker without prefix scoring:
    score = w_q * (1 - (q - q_min) / (q_max - q_min)) + w_kv * (1 - kv_usage),
    q the engine's waiting queue, both terms in [0, 1], weights 2 and 2."""

    name = "queue_kv_scorer"

    def __init__(self, queue_weight: float = 2.0, kv_weight: float = 2.0) -> None:
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight

    def choose(
        self,
        request: DispatchRequest,
        candidates: Sequence[InstanceView],
        rng: random.Random,
        seq: int,
    ) -> InstanceView:
        waiting = [v.engine_waiting for v in candidates]
        q_min = min(waiting)
        q_span = max(waiting) - q_min or 1  # all equal: every queue term is 1
        wq, wkv = self.queue_weight, self.kv_weight
        scores = [
            wq * (1.0 - (q - q_min) / q_span) + wkv * (1.0 - v.kv_usage)
            for q, v in zip(waiting, candidates, strict=True)
        ]
        return best(candidates, scores, rng)
