"""Llumnix rescheduling: which requests to move, from where, to where.

`plan_migrations` pairs the least free instances (sources) with the freest ones
(destinations), like Llumnix's pair-migration policy, and picks for each pair
the request whose move costs least:
- a request still queued in the source engine (no KV yet): moving it costs
  nothing and cuts its wait, so queued requests go first, oldest first;
- then running requests, lowest priority first, then shortest (in lite mode the
  destination recomputes prompt + generated tokens, so short ones are cheap).
A move must pay: the source must be over its capacity (freeness below
`source_below`, i.e. its virtual demand exceeds its KV memory, so vLLM will
queue or preempt and recompute something there anyway), the destination must
hold the request with `dest_reserve_blocks` to spare, and after the move the
destination must still be freer than the source (no ping-pong).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from proxy.policy.view import ClusterView, InstanceView, Priority
from proxy.policy.virtual_usage import instance_freeness, request_blocks


@dataclass(frozen=True, slots=True)
class RequestLoad:
    """One in-flight request as the rescheduler sees it."""

    id: int
    tokens: int  # prompt + generated so far
    priority: Priority
    running: bool  # False: still queued in the engine, holding no KV
    migratable: bool = True


@dataclass(frozen=True, slots=True)
class Migration:
    request_id: int
    source: str
    destination: str
    reason: str


@dataclass(frozen=True, slots=True)
class MigrationSettings:
    source_below: float = 0.0  # freeness (blocks/request) under which an instance sheds load
    dest_above: float = 4.0  # freeness a destination must have
    dest_reserve_blocks: int = 2  # room left on the destination after the move
    max_per_round: int = 4  # migrations started per plan
    move_running: bool = True  # False: only queued requests move (no migration mode)


def sources(view: ClusterView, settings: MigrationSettings) -> list[str]:
    """Instances that would shed load, least free first. The caller gathers
    `RequestLoad`s for these only, which keeps a planning round cheap."""
    over = [v for v in view.instances if v.healthy and v.freeness < settings.source_below]
    return [v.name for v in sorted(over, key=lambda v: v.freeness)]


def plan_migrations(
    view: ClusterView,
    requests: Mapping[str, Sequence[RequestLoad]],
    block_size: Mapping[str, int],
    settings: MigrationSettings,
) -> list[Migration]:
    """Moves for this round; `requests` holds the candidates of each source."""
    dests = sorted(
        (v for v in view.instances if v.dispatchable and v.freeness > settings.dest_above),
        key=lambda v: v.freeness,
        reverse=True,
    )
    src_views = {v.name: v for v in view.instances if v.name in requests}
    plan: list[Migration] = []
    for src_name, dest in zip(sources(view, settings), dests, strict=False):
        if len(plan) >= settings.max_per_round:
            break
        src = src_views.get(src_name)
        if src is None or src.name == dest.name:
            continue
        move = _pick(src, dest, requests[src_name], block_size.get(src_name, 16), settings)
        if move is not None:
            plan.append(move)
    return plan


def _pick(
    src: InstanceView,
    dest: InstanceView,
    candidates: Sequence[RequestLoad],
    block_size: int,
    settings: MigrationSettings,
) -> Migration | None:
    queued = sorted((r for r in candidates if not r.running and r.migratable), key=lambda r: r.id)
    running = sorted(
        (r for r in candidates if r.running and r.migratable),
        key=lambda r: (r.priority, r.tokens),
    )
    for r in queued + (running if settings.move_running else []):
        blocks = request_blocks(r.tokens + 1, block_size)
        room = dest.capacity_blocks - dest.virtual_blocks - settings.dest_reserve_blocks
        if blocks > room:
            continue
        src_after = instance_freeness(
            src.capacity_blocks, src.virtual_blocks - blocks, src.batch - 1
        )
        dest_after = instance_freeness(
            dest.capacity_blocks, dest.virtual_blocks + blocks, dest.batch + 1
        )
        if dest_after < src_after:
            continue
        what = "queued" if not r.running else f"running, {r.priority.name.lower()} priority"
        reason = (
            f"{src.name} freeness {src.freeness:.1f} < {settings.source_below:g}; "
            f"{dest.name} freeness {dest.freeness:.1f}; {what} request of {r.tokens} tokens"
        )
        return Migration(r.id, src.name, dest.name, reason)
    return None
