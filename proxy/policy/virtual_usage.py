"""Llumnix virtual usage (OSDI '24, section 5) and the freeness it yields.

A request's real usage is its KV blocks, ceil((prompt + generated) / block_size).
Its virtual usage adds what the scheduling goal needs:
- load balancing: virtual = real;
- de-fragmentation: a request counts its whole prompt from the moment it is
  dispatched, even while it waits in the engine's queue, so a large queued
  request makes its instance look full and pushes new work elsewhere;
- priority: an instance running high-priority requests reserves headroom for
  them: normal and low requests see it that much fuller and stay away (so its
  batch stays small and its queue short), while high-priority requests see it
  without the reservation (it is theirs). The headroom is
  `high_priority_headroom_blocks`, or by default `DEFAULT_HEADROOM_SHARE` of
  the instance's KV capacity (see `headroom_blocks`);
- draining: every request counts as infinite (freeness -inf, never chosen).
Freeness F = (M - sum of virtual usage) / B, M the instance's KV capacity in
blocks and B its batch size; larger is freer. Over capacity (a queue forms) F is
the negative surplus itself, M - sum of virtual usage, not divided by B. An idle
instance has B = 0 and counts as B = 1 so that F stays finite and bigger idle
instances rank first.

Prefix credit (issue 13): on an instance that already caches c of a request's
prompt tokens, the request's demand is only its uncached blocks and its prefill
only its uncached tokens. `freeness_after` is an instance's freeness once it
takes a request's uncached blocks; `prefill_ahead` is the prefill a request
waits for there (the queue's, then its own uncached tokens); `prefix_credit`
counts the cached blocks as free there, in freeness units, floor(c /
block_size) / max(B, 1) (moves pair sources and destinations with it). Where
nothing is cached the credit is 0 and the ranking is plain Llumnix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from proxy.policy.view import InstanceView

# The default headroom, as a share of an instance's KV capacity. About one
# typical request's KV: 1,000-2,000 16-token blocks on a 7B model's GPU give
# 100-200 blocks (a 1.6k-3.2k-token chat), a CPU vLLM's 15 128-token blocks give
# one 128/128 request's 1.5. A share, unlike a fixed count, means that on any
# engine and block size; small enough that an instance with headroom still
# ranks by its real load (freeness stays positive until it is 90% full).
DEFAULT_HEADROOM_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class UsageSettings:
    # KV blocks reserved where high-priority requests run; None: the default share.
    high_priority_headroom_blocks: float | None = None


def headroom_blocks(settings: UsageSettings, capacity_blocks: int) -> float:
    """Blocks reserved on an instance of `capacity_blocks` running high-priority
    requests: the configured count, else `DEFAULT_HEADROOM_SHARE` of its capacity
    (none where the capacity is unknown)."""
    if settings.high_priority_headroom_blocks is not None:
        return settings.high_priority_headroom_blocks
    return DEFAULT_HEADROOM_SHARE * max(capacity_blocks, 0)


def request_blocks(tokens: int, block_size: int) -> int:
    """KV blocks held by a sequence of `tokens` tokens (block_size >= 1)."""
    return -(-tokens // block_size) if tokens > 0 else 0


def virtual_usage(prompt_tokens: int, generated_tokens: int, block_size: int) -> int:
    """Usage of one in-flight request, in KV blocks (its real usage)."""
    return request_blocks(prompt_tokens + generated_tokens, block_size)


def instance_virtual_usage(
    real_blocks: float,
    high_priority_requests: int,
    settings: UsageSettings,
    *,
    for_high: bool,
    capacity_blocks: int = 0,
) -> float:
    """Sum of virtual usage on an instance, as a request of the given class sees it:
    the real blocks of its requests plus, for normal and low requests, the headroom
    reserved where high-priority requests run (`headroom_blocks`)."""
    if high_priority_requests and not for_high:
        return real_blocks + headroom_blocks(settings, capacity_blocks)
    return real_blocks


def instance_freeness(
    capacity_blocks: int, virtual_blocks: float, batch: int, *, draining: bool = False
) -> float:
    """F = (M - virtual_blocks) / max(B, 1) in blocks per request; over capacity
    (M < virtual_blocks) F = M - virtual_blocks, the blocks a new request queues
    behind.

    Dividing a negative surplus by B would rank the busier of two overloaded
    instances freer (-35/12 > -28/7): under overload new work would pile onto the
    longer queue. Both forms meet at 0, so adding a request never makes an
    instance freer. With an unknown capacity (M = 0: the engine does not publish
    its cache size) freeness degrades to -B, i.e. fewest requests first.
    """
    if draining:
        return -math.inf
    if capacity_blocks <= 0:
        return -float(batch)
    free = capacity_blocks - virtual_blocks
    return free if free < 0 else free / max(batch, 1)


def room_blocks(capacity_blocks: int, used_blocks: float, reserve_blocks: int) -> float:
    """Blocks a move may still put on an instance using `used_blocks` of
    `capacity_blocks` while keeping `reserve_blocks` free (negative: none)."""
    return capacity_blocks - used_blocks - reserve_blocks


def prefix_credit(cached_tokens: int, view: InstanceView) -> float:
    """Freeness a request gains on `view` from `cached_tokens` of its prompt
    already cached there: its full cached blocks per request (blocks/request)."""
    if cached_tokens <= 0:
        return 0.0
    return (cached_tokens // view.block_size) / max(view.batch, 1)


def freeness_after(freeness: float, view: InstanceView, blocks: int) -> float:
    """The freeness `view` would have with one more request of `blocks` blocks,
    from its freeness now (as the request's class sees it) and batch. An instance
    whose capacity is unknown is never known to be short: +inf."""
    if view.capacity_blocks <= 0:
        return math.inf
    free = freeness * max(view.batch, 1) if freeness >= 0 else freeness
    used = view.capacity_blocks - free + blocks
    return instance_freeness(view.capacity_blocks, used, view.batch + 1)


def prefill_ahead(prompt_tokens: int, cached_tokens: int, view: InstanceView) -> int:
    """Tokens `view` prefills before a request's first token: those queued there
    (ledger: prompts less what was cached at dispatch), then its uncached ones."""
    return view.queued_tokens + uncached_tokens(prompt_tokens, cached_tokens)


def uncached_tokens(prompt_tokens: int, cached_tokens: int) -> int:
    """The prefill a request costs on an instance caching `cached_tokens` of it."""
    return max(0, prompt_tokens - cached_tokens)


def instance_view(
    name: str,
    *,
    capacity_blocks: int,
    real_blocks: float,
    high_priority_requests: int,
    batch: int,
    inflight: int,
    settings: UsageSettings,
    kv_usage: float = 0.0,
    engine_running: int = 0,
    engine_waiting: int = 0,
    engine_preempted: int = 0,
    queued_tokens: int = 0,
    block_size: int = 16,
    healthy: bool = True,
    draining: bool = False,
    models: frozenset[str] = frozenset(),
    ejected: bool = False,
    assumed_capacity_blocks: int = 0,
) -> InstanceView:
    """One instance's view from its totals: the proxy (ledger + scrape) and the
    simulator build their views with this, so both rank instances alike.

    An engine that publishes no cache size (`capacity_blocks` 0) is ranked as if
    it had `assumed_capacity_blocks` (the proxy's: the mean size of the fleet's
    engines that publish one) where that is known: ranked by its requests alone
    (-B), beside engines ranked by free blocks per request, it took nothing
    while any of them had a block free. Its view's capacity stays unknown."""
    ranked = capacity_blocks if capacity_blocks > 0 else assumed_capacity_blocks
    virtual = instance_virtual_usage(
        real_blocks,
        high_priority_requests,
        settings,
        for_high=False,
        capacity_blocks=ranked,
    )
    virtual_high = instance_virtual_usage(
        real_blocks, high_priority_requests, settings, for_high=True
    )
    return InstanceView(
        name=name,
        freeness=instance_freeness(ranked, virtual, batch, draining=draining),
        freeness_high=instance_freeness(ranked, virtual_high, batch, draining=draining),
        inflight=inflight,
        capacity_blocks=capacity_blocks,
        virtual_blocks=virtual,
        batch=batch,
        kv_usage=kv_usage,
        engine_running=engine_running,
        engine_waiting=engine_waiting,
        engine_preempted=engine_preempted,
        queued_tokens=queued_tokens,
        block_size=block_size,
        healthy=healthy,
        draining=draining,
        models=models,
        ejected=ejected,
    )
