"""Dispatch policies: Llumnix virtual usage and the baselines peers use.

Every policy has one signature, `choose(request, candidates, rng, seq)`, and sees
only candidates that the runner (`dispatch.dispatch`) already filtered to healthy,
non-draining instances serving the model. Ties are broken at random among the
best, so a burst between two scrapes does not pile onto the first name.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from proxy.policy.view import DispatchRequest, InstanceView


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
    candidates: Sequence[InstanceView], score: Callable[[InstanceView], float], rng: random.Random
) -> InstanceView:
    """The candidate with the highest score; ties at random. One pass."""
    top: list[InstanceView] = []
    top_score = -float("inf")
    for view in candidates:
        s = score(view)
        if s > top_score:
            top_score, top = s, [view]
        elif s == top_score:
            top.append(view)
    if not top:  # every score was -inf (e.g. all draining): still answer
        top = list(candidates)
    return top[0] if len(top) == 1 else rng.choice(top)


class Llumnix:
    """Freest instance by virtual usage: argmax F = (M - sum V) / B.

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
        if self.topk <= 1 or len(candidates) <= 1:
            return best(candidates, _freeness, rng)
        ranked = sorted(candidates, key=_freeness, reverse=True)
        return rng.choice(ranked[: self.topk])


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
        return best(candidates, _neg_inflight, rng)


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
        return best(candidates, _neg_kv_usage, rng)


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
        if len(candidates) <= 2:
            return best(candidates, _neg_inflight, rng)
        return best(rng.sample(list(candidates), 2), _neg_inflight, rng)


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
        q_min = min(v.engine_waiting for v in candidates)
        q_span = max(v.engine_waiting for v in candidates) - q_min

        def score(v: InstanceView) -> float:
            queue = 1.0 if q_span == 0 else 1.0 - (v.engine_waiting - q_min) / q_span
            return self.queue_weight * queue + self.kv_weight * (1.0 - v.kv_usage)

        return best(candidates, score, rng)


def _freeness(v: InstanceView) -> float:
    return v.freeness


def _neg_inflight(v: InstanceView) -> float:
    return -v.inflight


def _neg_kv_usage(v: InstanceView) -> float:
    return -v.kv_usage
