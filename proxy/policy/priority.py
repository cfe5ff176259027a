"""Priority: making room for a high-priority request on the instance it was given.

Llumnix reserves headroom for high-priority requests in virtual usage, so
dispatch already steers them to room. When no instance has room, the request
still goes to the freest one as a high-priority request sees it; rather than
let it wait for memory there, one lower-priority stream moves off that instance.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.policy.migration import RequestLoad
from proxy.policy.view import InstanceView, Priority


def lacks_room(chosen: InstanceView, blocks_needed: int) -> bool:
    """Whether a high-priority request of `blocks_needed` KV blocks does not fit
    on `chosen` (of known capacity): room is M - V without the high-priority
    headroom (`freeness_high` x batch)."""
    room = chosen.freeness_high * max(chosen.batch, 1)
    return bool(chosen.capacity_blocks) and room < blocks_needed


def make_room_victim(
    chosen: InstanceView,
    blocks_needed: int,
    candidates: Sequence[RequestLoad],
    elsewhere: Sequence[InstanceView],
) -> int | None:
    """The id of the request to move off `chosen` so that a high-priority request
    of `blocks_needed` KV blocks fits, or None when it fits already, the capacity
    is unknown, or nothing can move.

    The victim is the lowest-priority, then shortest, movable request below high
    priority that one of the instances `elsewhere` can take (its model, its
    context): the cheapest to move and the one that least deserves to stay.
    """
    if not lacks_room(chosen, blocks_needed):
        return None
    others = [d for d in elsewhere if d.name != chosen.name and d.dispatchable]
    victims = [
        r
        for r in candidates
        if r.priority < Priority.HIGH and r.migratable and any(r.served_by(d) for d in others)
    ]
    if not victims:
        return None
    return min(victims, key=lambda r: (r.priority, r.tokens, r.id)).id
