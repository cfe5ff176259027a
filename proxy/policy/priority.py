"""Priority: making room for a high-priority request on the instance it was given.

Llumnix reserves headroom for high-priority requests in virtual usage, so
dispatch already steers them to room. When no instance has room, the request
still goes to the freest one as a high-priority request sees it; rather than
let it wait for memory there, lower-priority requests move off that instance,
as many as free the blocks it needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.policy.migration import RequestLoad
from proxy.policy.view import InstanceView, Priority
from proxy.policy.virtual_usage import request_blocks


def lacks_room(chosen: InstanceView, blocks_needed: int) -> bool:
    """Whether a high-priority request of `blocks_needed` KV blocks does not fit
    on `chosen` (of known capacity): room is M - V without the high-priority
    headroom (`freeness_high` x batch)."""
    return bool(chosen.capacity_blocks) and _room(chosen) < blocks_needed


def make_room_victims(
    chosen: InstanceView,
    blocks_needed: int,
    candidates: Sequence[RequestLoad],
    elsewhere: Sequence[InstanceView],
) -> list[int]:
    """The ids of the requests to move off `chosen` so that a high-priority
    request of `blocks_needed` KV blocks fits there; none when it fits already,
    the capacity is unknown, or nothing can move.

    Enough is the blocks `chosen` lacks, and no more than the request's own:
    virtual usage counts the queue's demand too, and the request starts once
    its own blocks are free. Victims come from the lowest priority below high
    first (a normal request moves only where the low ones cannot free enough);
    among those, a queued request first (no KV to recompute), then the one
    smallest that frees enough alone (the cheapest to recompute), else the
    largest first (the fewest moves); where nothing frees enough, the one that
    frees the most. Each must have an instance `elsewhere` that serves it (its
    model, its context). Where that instance is full too it queues there: the
    simulator's high-priority TTFT was lower so than with moves held to
    instances with room (`loadtest/bench_priority_room.py`).
    """
    if not lacks_room(chosen, blocks_needed):
        return []
    enough = min(blocks_needed - _room(chosen), blocks_needed)
    others = [d for d in elsewhere if d.name != chosen.name and d.dispatchable]
    movable = [
        r
        for r in candidates
        if r.priority < Priority.HIGH and r.migratable and any(r.served_by(d) for d in others)
    ]
    for tier in sorted({r.priority for r in movable}):
        pool = [r for r in movable if r.priority <= tier]
        picked = _covering(pool, enough, chosen.block_size)
        if picked:
            return picked
    if not movable:
        return []
    # Nothing frees enough (or Ferry undercounts what they hold: an engine that
    # reports no token ids): the lowest-priority request that frees the most.
    size = chosen.block_size
    return [max(movable, key=lambda r: (-r.priority, request_blocks(r.tokens, size), -r.id)).id]


def _room(view: InstanceView) -> float:
    """Blocks free on `view` for a high-priority request (its headroom included)."""
    return view.freeness_high * max(view.batch, 1)


def _covering(pool: Sequence[RequestLoad], enough: float, block_size: int) -> list[int]:
    """Requests of `pool` whose moves free `enough` blocks (see `make_room_victims`)."""

    def freed(r: RequestLoad) -> int:
        return request_blocks(r.tokens, block_size)

    for r in sorted(pool, key=lambda r: (r.priority, r.running, freed(r), r.id)):
        if freed(r) >= enough:
            return [r.id]
    picked: list[int] = []
    total = 0
    for r in sorted(pool, key=lambda r: (r.priority, r.running, -freed(r), r.id)):
        picked.append(r.id)
        total += freed(r)
        if total >= enough:
            return picked
    return []
