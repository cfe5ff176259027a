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
from proxy.policy.virtual_usage import (
    freeness_after,
    prefill_ahead,
    request_blocks,
    uncached_tokens,
)


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


# A cached prefix may draw a request to an instance with more in flight than
# the least busy candidate, but not to one with over CROWD_FACTOR times as many
# plus CROWD_GRACE (the defaults of `crowd_factor` and `crowd_grace`). Without
# that bound one hot prompt piles onto its holder while memory lasts and every
# stream there decodes in a crowded batch (simulated, 16 instances, one system
# prompt: P99 TTFT 0.95 s against plain llumnix's 0.02 s). A bound on requests,
# not freeness, because it holds across instances of any size: a small engine
# beside a roomy one still takes the prompts it caches. vllm-router's
# cache_aware bounds the same imbalance with its balance thresholds (in-flight
# counts apart by a factor and by an amount), far looser. Too tight a bound
# sends requests away from their prompt to pay a cold prefill, which is the tail
# wherever prefill is dear: 2x + 4 was best or near it, simulated and on real
# vLLM, from 0.1 ms a prefill token up (README "Setting the crowd bound").
CROWD_FACTOR = 2.0
CROWD_GRACE = 4.0

# A prompt placed away from the instance caching it is prefilled cold there: the
# request waits for the tokens it lacks, and so does the next request queued
# behind it. So those tokens weigh COLD_PREFILL_WEIGHT times against the queue
# it would skip. Weighed once, a request left its cache whenever the holder's
# queue was longer by more than the tokens it saved, and each such prefill
# lengthened the queues and took cache room from other prefixes (simulated,
# loadtest.bench_prefix, 16 instances, 10 traces: hit rate 0.828 -> 0.843,
# P99 TTFT 2.15 s -> 2.13 s; 2 instances of 64 128-token blocks, turns without
# a session, 20 traces: 0.841 -> 0.852).
COLD_PREFILL_WEIGHT = 2

# A request goes to an instance with no prefill queued only where that instance
# stays at least this share as free as the freest would after taking it: the
# queue decides between instances of like memory, and memory still keeps an
# instance far less free from taking work because its queue happens to be
# empty (one simulated trace, 16 instances at 60/s with lite moves, 0.3 ms a
# prefill token and 0.5 ms a decoding request: with any instance free enough
# taking it, P99 TTFT 2.15 s against 1.57 s).
UNQUEUED_FREE_SHARE = 0.5


class Llumnix:
    """Freest instance by virtual usage: argmax F = (M - sum V) / B.

    High-priority requests rank instances by `freeness_high` (headroom reserved
    for their class not counted); the rest by `freeness`.

    With `prefix_credit` on and more of the prompt cached on some candidates
    than on others, the request goes where its first token comes soonest
    without crowding memory: among the instances that stay free enough after
    taking it (freeness at or above `safe_freeness`, its cached blocks not
    counted as demand there: virtual_usage.freeness_after) and not crowded
    (at most `crowd_factor` x the fewest requests any candidate has, plus
    `crowd_grace`), the one with the least prefill ahead of it, the prefill queued
    there plus its own uncached tokens (virtual_usage.prefill_ahead), its own
    counted `COLD_PREFILL_WEIGHT` times (`prefill_cost`); ties go to the freer.
    Time, not blocks: a cached prefix saves its prefill,
    which is what a user waits for, while the memory it saves is a few blocks
    among hundreds. Where no uncrowded instance stays free enough, memory
    decides: the uncrowded instance left freest after taking the request, its
    cached blocks not counted as demand. Where every candidate caches as much
    of the prompt (none of it, or a chat template's first block), the ranking
    is plain F. With a session
    (`request.affinity`), its last instance is kept while it is free enough and
    no other is freer by more than `affinity_margin` blocks per request: a soft
    preference, so a session follows its cache but never onto an instance that
    is full.

    With `prefill_aware` on, where some candidates have a prefill queued (the
    ledger's uncached prompt tokens still waiting for a first token) and others
    none, the request goes to the freest with none, among those left at least
    `UNQUEUED_FREE_SHARE` as free per request as the freest (and at least
    `safe_freeness`): behind a queued prefill a request waits for it, beside
    decoding requests it starts at the next step. A session kept on its
    instance and a cached prefix (`prefix_credit`, which weighs the queue
    itself) decide before it; it decides before `topk`.
    Memory balance alone is blind to that (`loadtest.bench_prefill_aware`, 60/s:
    P50 TTFT 0.105 s against 0.142 s). The ledger marks the prefill at
    dispatch, so a burst spreads before any scrape.

    Use it when requests differ in length: it balances KV memory per request,
    not request counts. `topk` > 1 picks at random among the k freest, which
    spreads a burst that arrives faster than the ledger can tell instances apart.
    """

    name = "llumnix"

    def __init__(
        self,
        topk: int = 1,
        prefix_credit: bool = False,
        affinity_margin: float = 32.0,
        safe_freeness: float = 1.0,
        crowd_factor: float = CROWD_FACTOR,
        crowd_grace: float = CROWD_GRACE,
        prefill_aware: bool = True,
    ) -> None:
        self.topk = topk
        self.prefill_aware = prefill_aware
        self.prefix_credit = prefix_credit
        self.affinity_margin = affinity_margin
        self.safe_freeness = safe_freeness
        self.crowd_factor = crowd_factor
        self.crowd_grace = crowd_grace

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
        if self.prefix_credit:
            local = self._affine(request, candidates, scores) or self._soonest(
                request, candidates, scores, rng
            )
            if local is not None:
                return local
        if self.prefill_aware:
            unqueued = self._unqueued(request, candidates, scores, rng)
            if unqueued is not None:
                return unqueued
        if self.topk <= 1 or len(candidates) <= 1:
            return best(candidates, scores, rng)
        ranked = sorted(zip(scores, range(len(candidates)), strict=True), reverse=True)
        return candidates[rng.choice(ranked[: self.topk])[1]]

    def _safe(self, request: DispatchRequest, v: InstanceView, score: float) -> bool:
        return _after(request, v, score) >= self.safe_freeness

    def _soonest(
        self,
        request: DispatchRequest,
        candidates: Sequence[InstanceView],
        scores: list[float],
        rng: random.Random,
    ) -> InstanceView | None:
        """Among the instances free enough, the one where the request's prefill
        costs least (`prefill_cost`: the queue there, then its own uncached
        tokens counted twice); None when the cache tells no candidate
        apart: nothing cached anywhere, or the same length cached on every one
        (a chat template's first block, a prompt every instance has seen), where
        locality is no reason to leave plain F."""
        cached = request.cached_tokens
        lengths = {cached.get(v.name, 0) for v in candidates}
        if len(lengths) == 1:
            return None
        crowded = self.crowd_factor * min(v.batch for v in candidates) + self.crowd_grace
        uncrowded = [
            (v, score) for v, score in zip(candidates, scores, strict=True) if v.batch <= crowded
        ]
        after = [_after(request, v, score) for v, score in uncrowded]
        safe = [pair for pair, a in zip(uncrowded, after, strict=True) if a >= self.safe_freeness]
        if not safe:
            # Memory is short everywhere: the freest after taking the request,
            # its cached blocks not counted as demand. Plain F here would
            # scatter prompts away from their caches just when recomputing
            # them costs most (simulated overload: hit rate 0.29 against 0.73).
            return best([v for v, _ in uncrowded], after, rng)
        ahead = [prefill_cost(request.prompt_tokens, cached.get(v.name, 0), v) for v, _ in safe]
        least = min(ahead)
        soonest = [pair for pair, a in zip(safe, ahead, strict=True) if a == least]
        return best([v for v, _ in soonest], [score for _, score in soonest], rng)

    def _unqueued(
        self,
        request: DispatchRequest,
        candidates: Sequence[InstanceView],
        scores: list[float],
        rng: random.Random,
    ) -> InstanceView | None:
        """The freest instance with no prefill queued, among those free enough
        after taking the request; None where the queues tell no candidate apart
        (all have a prefill queued, or none has) or no unqueued one is free enough."""
        queued = [v.queued_tokens > 0 for v in candidates]
        if all(queued) or not any(queued):
            return None
        after = [_after(request, v, score) for v, score in zip(candidates, scores, strict=True)]
        # Against the freest whose capacity is known: one that publishes none
        # (+inf after) must not lower the bar for the others.
        top = max((a for a in after if a != math.inf), default=-math.inf)
        enough = max(self.safe_freeness, UNQUEUED_FREE_SHARE * top)
        pairs = [
            (v, score)
            for v, score, a, q in zip(candidates, scores, after, queued, strict=True)
            if not q and a >= enough
        ]
        if not pairs:
            return None
        return best([v for v, _ in pairs], [score for _, score in pairs], rng)

    def _affine(
        self, request: DispatchRequest, candidates: Sequence[InstanceView], scores: list[float]
    ) -> InstanceView | None:
        """The session's instance, if it is free enough and within
        `affinity_margin` of the freest."""
        name = request.affinity
        if name is None:
            return None
        for v, score in zip(candidates, scores, strict=True):
            if v.name == name:
                near = score >= max(scores) - self.affinity_margin
                return v if near and self._safe(request, v, score) else None
        return None


def prefill_cost(prompt_tokens: int, cached_tokens: int, v: InstanceView) -> int:
    """What placing a prompt on `v` costs in prefill tokens: the prefill ahead of
    its first token there, its own uncached tokens weighed `COLD_PREFILL_WEIGHT`
    times (the next request queued there waits for them too)."""
    uncached = uncached_tokens(prompt_tokens, cached_tokens)
    return prefill_ahead(prompt_tokens, cached_tokens, v) + (COLD_PREFILL_WEIGHT - 1) * uncached


def _after(request: DispatchRequest, v: InstanceView, score: float) -> float:
    """`v`'s freeness once it takes the request, counting as demand only the
    blocks of the prompt it does not cache."""
    cached = request.cached_tokens.get(v.name, 0)
    blocks = request_blocks(uncached_tokens(request.prompt_tokens, cached), v.block_size)
    return freeness_after(score, v, blocks)


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


class CacheAware:
    """vllm-router's (and SGLang's) default `cache_aware`, over Ferry's prefix index.

    - Imbalanced (max - min in-flight > `balance_abs_threshold` and
      max > min * `balance_rel_threshold`): fewest requests in flight.
    - Else, when the best prefix match covers more than `cache_threshold` of the
      prompt (cached / prompt tokens): the best match.
    - Else fewest in flight. (vllm-router takes the instance with the smallest
      tree here, i.e. the most cache room; Ferry's index is bounded per instance
      so fewest in flight stands in for it.)
    Defaults are vllm-router's: 0.3, 64, 1.5. Load is Ferry's in-flight count,
    as vllm-router counts its own running requests.
    """

    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def choose(
        self,
        request: DispatchRequest,
        candidates: Sequence[InstanceView],
        rng: random.Random,
        seq: int,
    ) -> InstanceView:
        loads = [-float(v.inflight) for v in candidates]
        most, least = -min(loads), -max(loads)
        imbalanced = (
            most - least > self.balance_abs_threshold and most > least * self.balance_rel_threshold
        )
        cached = request.cached_tokens
        if not imbalanced and cached and request.prompt_tokens > 0:
            matches = [float(cached.get(v.name, 0)) for v in candidates]
            if max(matches) / request.prompt_tokens > self.cache_threshold:
                return best(candidates, matches, rng)
        return best(candidates, loads, rng)
