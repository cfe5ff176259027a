"""Llumnix virtual usage (OSDI '24, section 5) and the freeness it yields.

A request's real usage is its KV blocks, ceil((prompt + generated) / block_size).
Its virtual usage adds what the scheduling goal needs:
- load balancing: virtual = real;
- de-fragmentation: a request counts its whole prompt from the moment it is
  dispatched, even while it waits in the engine's queue, so a large queued
  request makes its instance look full and pushes new work elsewhere;
- priority: a high-priority request reserves `high_priority_headroom_blocks` on its
  instance, so normal and low requests see that instance as fuller and stay away;
- draining: every request counts as infinite (freeness -inf, never chosen).
Freeness F = (M - sum of virtual usage) / B, M the instance's KV capacity in
blocks and B its batch size; larger is freer. An idle instance has B = 0 and
counts as B = 1 so that F stays finite and bigger idle instances rank first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from proxy.policy.view import Priority


@dataclass(frozen=True, slots=True)
class UsageSettings:
    high_priority_headroom_blocks: float = 0.0


def request_blocks(tokens: int, block_size: int) -> int:
    """KV blocks held by a sequence of `tokens` tokens (block_size >= 1)."""
    return -(-tokens // block_size) if tokens > 0 else 0


def virtual_usage(
    prompt_tokens: int,
    generated_tokens: int,
    priority: Priority,
    block_size: int,
    settings: UsageSettings,
) -> float:
    """Virtual usage of one in-flight request, in KV blocks."""
    real = request_blocks(prompt_tokens + generated_tokens, block_size)
    if priority is Priority.HIGH:
        return real + settings.high_priority_headroom_blocks
    return float(real)


def instance_virtual_usage(
    real_blocks: float, high_priority_requests: int, settings: UsageSettings
) -> float:
    """Sum of `virtual_usage` over an instance's requests, from running totals:
    the sum of their real blocks plus the headroom of each high-priority one."""
    return real_blocks + high_priority_requests * settings.high_priority_headroom_blocks


def instance_freeness(
    capacity_blocks: int, virtual_blocks: float, batch: int, *, draining: bool = False
) -> float:
    """F = (M - virtual_blocks) / max(B, 1) in blocks per request.

    With an unknown capacity (M = 0: the engine does not publish its cache size)
    freeness degrades to -B, i.e. fewest requests first.
    """
    if draining:
        return -math.inf
    if capacity_blocks <= 0:
        return -float(batch)
    return (capacity_blocks - virtual_blocks) / max(batch, 1)
