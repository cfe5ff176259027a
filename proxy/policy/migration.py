"""Llumnix rescheduling: which requests to move, from where, to where.

`plan_migrations` pairs the least free instances (sources) with the freest ones
(destinations), like Llumnix's pair-migration policy, and picks for each pair
the request whose move pays most:
- running requests the engine has preempted already (see "Rescue" below): their
  stall is under way, and vLLM queues a preempted request ahead of every other
  waiting one, so it holds up the source's queue too;
- then requests still queued in the source engine (no KV yet): moving one costs
  nothing and cuts its wait, oldest first;
- then running requests, lowest priority first, then shortest (in lite mode the
  destination recomputes prompt + generated tokens, so short ones are cheap).
A move must pay: the source must be short of memory (freeness below
`source_below`, default 1: less than one free KV block per request, so its
running requests, each of which takes a new block every `block_size` tokens,
will soon make vLLM preempt and recompute one of them, or its queue waits), the
destination must be free (freeness above `dest_above`) and hold the request
with `dest_reserve_blocks` to spare, and after the move the destination must
still be freer than the source (no ping-pong).

Drain. `plan_drain` moves requests off draining instances as Llumnix does: a
running one only where its blocks fit, the rest staying where they decode until
room appears (see its docstring).

Rescue. vLLM puts a preempted request back in its queue, where it produces
nothing until memory frees. The proxy cannot see preemption per request, but it
sees its signs: the engine's scraped queue holds more requests than the ledgers
have waiting for a first token (`InstanceView.engine_preempted`),
and some of its streams have been silent for `stalled_after_s`. The most silent
of them, as many as the excess, are moved at once (`stalled_requests`), from any
instance, to any destination with room that ends up no less free than the source
is now; the recompute test (1) below does not apply (the source would recompute
them too), (2) and (3) do, and the move skips the pre-warm (the source is not
decoding them, so there is nothing to overlap).

In lite mode a moved running request is not free: the destination prefills its
prompt + generated tokens again (with pre-warm nearly all of that prefill still
happens there, only earlier). `preemption_due` and `recompute_refusal` count that
cost against the stall the move saves and the first-token wait of the
destination's queue:

    T       = P + G                                   tokens the destination recomputes
    cost_s  = T / prefill_tokens_per_s                its prefill time for them
    B       = the destination's batch (running + queued requests)
    R       = the source's running requests (they have streamed tokens)
    move only if
      (0) virtual_blocks - queued_tokens / block_size + |R| > capacity   (the source's)
      (1) cost_s * (1 + B) <= preemption_stall_s      the move pays for itself
      (2) (queued_tokens + T) / prefill_tokens_per_s <= dest_ttft_slack_s
      (3) the destination's engine queue is one the ledger can size

(0): there is a stall to save only when the running requests alone will outgrow
the source's memory within about `block_size` steps (each needs one more block),
so that the engine preempts one of them and recomputes it later; a source over
capacity only by its queued requests (no KV yet) makes them wait, and moving
those is free. (1): the prefill holds up every stream on the destination and the
moved one by about cost_s; together that must stay below the stall of the one
preemption the move spares the source (its victim waits for memory, then
recomputes). (2): requests queued on the destination, and whoever is dispatched
there next, wait for its queued prefill plus the recompute; that must fit in the
slack, so a move never pushes them past their TTFT (with an empty queue it bounds
the recompute alone). (3): an engine reporting waiting requests while the ledger
has none queued there (traffic that bypassed Ferry, its own preemptions, a stale
scrape) has a queue of unknown size: no recompute goes there. Queued requests
(no KV yet) and full-mode moves (`count_recompute=False`: the KV moves along)
skip these tests.

Pre-warm. A lite move of a running request may first send P + G to the
destination as a one-token request, so that its prefix cache holds them and the
cut-over recomputes almost nothing while the source goes on decoding. That costs
the move a trip through the destination's queue (an engine step or more), during
which a source short of memory may preempt the very request being moved. So a
move pre-warms only when the recompute it saves, tail / prefill_tokens_per_s, is
at least `prewarm_min_recompute_s` (about one decode step); a rescued request
never does (its source is not decoding it: there is nothing to overlap), and the
migrator gives up waiting on a pre-warm as soon as the stream stops producing.

Prefix credit (issue 13): a request whose tokens are partly cached on a
destination (`RequestLoad.cached`, from the prefix index) recomputes only the
uncached tail there, so T above is P + G - cached; running requests are tried
cheapest tail first; and each source is paired with the free destination that
ranks best by freeness plus the largest prefix credit among the source's
candidates (virtual_usage.prefix_credit), so moves keep locality.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from proxy.policy.view import ClusterView, InstanceView, Priority
from proxy.policy.virtual_usage import (
    instance_freeness,
    prefix_credit,
    request_blocks,
    room_blocks,
    uncached_tokens,
)

_NOTHING_CACHED: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RequestLoad:
    """One in-flight request as the rescheduler sees it."""

    id: int
    tokens: int  # prompt + generated so far
    priority: Priority
    running: bool  # False: still queued in the engine, holding no KV
    migratable: bool = True
    # Its tokens probably cached on other instances (name -> tokens; absent: 0).
    cached: Mapping[str, int] = field(default_factory=lambda: _NOTHING_CACHED)
    silent_s: float = 0.0  # running: seconds since its last token came through
    model: str | None = None  # the model it asked for (None: any instance serves it)
    # Instances serving its model whose context is too short for all it may
    # reach (prompt + its whole budget): there a continuation would end early.
    short_context: frozenset[str] = frozenset()

    def served_by(self, dest: InstanceView) -> bool:
        return (self.model is None or self.model in dest.models) and (
            dest.name not in self.short_context
        )

    def tail(self, instance: str) -> int:
        """Tokens a lite move to `instance` recomputes: those not cached there."""
        return uncached_tokens(self.tokens, self.cached.get(instance, 0))


@dataclass(frozen=True, slots=True)
class Migration:
    request_id: int
    source: str
    destination: str
    reason: str
    preempted: bool = False  # a rescue: the engine has stopped the request already
    # Lite: warm the destination's prefix cache with P + G before the cut-over (see
    # "Pre-warm" in the module docstring).
    prewarm: bool = False


@dataclass(frozen=True, slots=True)
class MigrationSettings:
    source_below: float = 1.0  # freeness (blocks/request) under which an instance sheds load
    dest_above: float = 4.0  # freeness a destination must have
    dest_reserve_blocks: int = 2  # room left on the destination after the move
    max_per_round: int = 4  # migrations started per plan
    move_running: bool = True  # False: only queued requests move (no migration mode)
    # Lite mode's cost model (the module docstring gives the formula).
    count_recompute: bool = True  # False: the KV moves with the request (full mode)
    # A destination's prefill rate, tokens/s. 10,000 is conservative for a 7-8B model
    # on one data-center GPU (they prefill several times faster); too low only makes
    # moves rarer.
    prefill_tokens_per_s: float = 10_000.0
    # The stall one preemption costs its victim on an over-capacity source: it waits
    # for memory, then recomputes. Seconds, typically (bench_scale measures a P99
    # worst stall of about 2 s without rebalancing).
    preemption_stall_s: float = 1.0
    # How much longer a move may make the destination's queued requests (and its next
    # arrivals) wait for their first token, seconds.
    dest_ttft_slack_s: float = 0.2
    # A running request this silent, on a source whose engine queues more requests
    # than the ledger has waiting for a first token, is taken for preempted (0: never).
    # Every moment of it is the rescued stream's stall. On bench_scale's trace the
    # simulator puts the P99 worst stall with rebalancing 10x below that without at
    # 0.2, 5x at 0.3, for the same TTFT; live runs (three pooled rounds each) gave
    # 5.3x, 11.4x and 11.8x at 0.2, 4.6x to 8.4x at 0.3: close to their noise. Shorter
    # risks taking a stream of a slow engine for preempted whenever a stale scrape
    # still counts a started request as waiting.
    stalled_after_s: float = 0.2
    # A lite move pre-warms its destination when the recompute it saves at the
    # cut-over would take at least this long (seconds at prefill_tokens_per_s).
    prewarm_min_recompute_s: float = 0.05

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0 (got {self.prefill_tokens_per_s})")
        if (
            min(
                self.preemption_stall_s,
                self.dest_ttft_slack_s,
                self.stalled_after_s,
                self.prewarm_min_recompute_s,
            )
            < 0
        ):
            raise ValueError(
                "preemption_stall_s, dest_ttft_slack_s, stalled_after_s and"
                " prewarm_min_recompute_s must be >= 0"
            )


def sources(view: ClusterView, settings: MigrationSettings) -> list[str]:
    """Instances that would shed load, least free first: those over capacity, and
    those whose engine queues requests (some may be preempted streams). The caller
    gathers `RequestLoad`s for these only, which keeps a planning round cheap."""
    rescue = settings.stalled_after_s > 0 and settings.move_running
    shedding = [
        v
        for v in view.instances
        if v.healthy and (_over(v, settings) or (rescue and v.engine_preempted > 0))
    ]
    return [v.name for v in sorted(shedding, key=lambda v: v.freeness)]


def _over(src: InstanceView, settings: MigrationSettings) -> bool:
    return src.freeness < settings.source_below


def plan_migrations(
    view: ClusterView,
    requests: Mapping[str, Sequence[RequestLoad]],
    block_size: Mapping[str, int],
    settings: MigrationSettings,
) -> list[Migration]:
    """Moves for this round; `requests` holds the candidates of each source."""
    dests = sorted(
        (v for v in view.instances if v.dispatchable), key=lambda v: v.freeness, reverse=True
    )
    src_views = {v.name: v for v in view.instances if v.name in requests}
    plan: list[Migration] = []
    for src_name in sources(view, settings):
        if len(plan) >= settings.max_per_round or not dests:
            break
        src = src_views.get(src_name)
        if src is None:
            continue
        candidates = requests[src_name]
        stalled = stalled_requests(src, candidates, settings)
        # A preempted stream may go wherever it fits now (`_pick` checks the room):
        # it is stalled already. Other moves need a destination free enough.
        eligible = dests if stalled else [d for d in dests if d.freeness > settings.dest_above]
        dest = _pair(src_name, eligible, candidates)
        if dest is None:
            continue
        dests.remove(dest)  # one move per destination per round, as pairs
        size = block_size.get(src_name, 16)
        move = _pick(src, dest, candidates, stalled, size, settings)
        # A preempted stream waits for nothing but a destination: when the one paired
        # with its source refuses it (queue, room), the next ones are asked for it alone.
        others = list(dests) if stalled else []
        while move is None and others:
            dest = _pair(src_name, others, stalled)
            if dest is None:
                break
            others.remove(dest)
            move = _pick(src, dest, stalled, stalled, size, settings)
            if move is not None:
                dests.remove(dest)
        if move is not None:
            plan.append(move)
    return plan


def _pair(
    src_name: str, dests: Sequence[InstanceView], candidates: Sequence[RequestLoad]
) -> InstanceView | None:
    """The destination for a source: the freest that can take one of its
    candidates (their model, their context), counting the best prefix credit
    any of them has there (without any: the freest)."""
    best: InstanceView | None = None
    best_score = -math.inf
    for dest in dests:
        if dest.name == src_name or not any(r.served_by(dest) for r in candidates):
            continue
        credit = max(
            (prefix_credit(r.cached.get(dest.name, 0), dest) for r in candidates), default=0
        )
        score = dest.freeness + credit
        if score > best_score:
            best, best_score = dest, score
    return best


def _pick(
    src: InstanceView,
    dest: InstanceView,
    candidates: Sequence[RequestLoad],
    stalled: Sequence[RequestLoad],
    block_size: int,
    settings: MigrationSettings,
) -> Migration | None:
    queued = sorted((r for r in candidates if not r.running and r.migratable), key=lambda r: r.id)
    running = sorted(
        (r for r in candidates if r.running and r.migratable and r not in stalled),
        key=lambda r: (r.priority, r.tail(dest.name)),
    )
    if not settings.move_running:
        running = []
    elif settings.count_recompute and not preemption_due(src, running, block_size):
        running = []  # only queued work makes it over capacity: nothing running is at risk
    if not _over(src, settings) or dest.freeness <= settings.dest_above:
        queued, running = [], []  # only its preempted streams may move, or go there
    for r in [*stalled, *queued, *running]:
        if not r.served_by(dest):
            continue
        # Blocks as each engine counts them: their block sizes may differ.
        blocks_there = request_blocks(r.tokens + 1, dest.block_size)
        if blocks_there > room_blocks(
            dest.capacity_blocks, dest.virtual_blocks, settings.dest_reserve_blocks
        ):
            continue
        src_after = instance_freeness(
            src.capacity_blocks,
            src.virtual_blocks - request_blocks(r.tokens + 1, block_size),
            src.batch - 1,
        )
        dest_after = instance_freeness(
            dest.capacity_blocks, dest.virtual_blocks + blocks_there, dest.batch + 1
        )
        # No ping-pong: the destination stays freer than the source. A preempted
        # stream holds no KV on its source, so its move frees nothing there: the
        # destination need only end up no less free than the source is now.
        if dest_after < (src.freeness if r in stalled else src_after):
            continue
        if r.running and settings.count_recompute:
            refusal = recompute_refusal(r.tail(dest.name), dest, settings, r in stalled)
            if refusal is not None:
                continue
        if r in stalled:
            why = f"{src.name} engine queues {src.engine_preempted} more than Ferry has waiting"
            what = f"running, silent {r.silent_s:.2f}s (preempted)"
        else:
            why = f"{src.name} freeness {src.freeness:.1f} < {settings.source_below:g}"
            what = "queued" if not r.running else f"running, {r.priority.name.lower()} priority"
        reason = (
            f"{why}; {dest.name} freeness {dest.freeness:.1f}; {what} request of {r.tokens} tokens"
        )
        prewarm = r.running and r not in stalled
        if r.running and settings.count_recompute:
            tail = r.tail(dest.name)
            cost = tail / settings.prefill_tokens_per_s
            prewarm = prewarm and cost >= settings.prewarm_min_recompute_s
            reason += f"; recompute {cost:.3f}s x {dest.batch + 1} streams"
            if tail < r.tokens:
                reason += f" ({r.tokens - tail} tokens cached there)"
            if prewarm:
                reason += ", pre-warmed"
        return Migration(r.id, src.name, dest.name, reason, preempted=r in stalled, prewarm=prewarm)
    return None


def plan_drain(
    view: ClusterView,
    requests: Mapping[str, Sequence[RequestLoad]],
    reserve_blocks: int = 2,
) -> list[Migration]:
    """Moves off draining instances (`requests` holds each one's movable
    requests), as Llumnix drains: a running request moves only to an instance
    with room for its blocks, `reserve_blocks` to spare, counting the moves
    planned before it; among those, to the freest counting its prefix credit
    there. One that no instance has room for goes on decoding where it is and is
    asked again next round: moved onto a full instance it would queue there, and
    stall, instead. A queued request holds no KV and waits either way: it goes
    to the freest instance serving its model. Higher priority first, then
    shorter (more of them fit)."""
    dests = [v for v in view.instances if v.dispatchable]
    used = {d.name: d.virtual_blocks for d in dests}
    batch = {d.name: d.batch for d in dests}
    plan: list[Migration] = []
    for src_name, loads in requests.items():
        movable = sorted(
            (r for r in loads if r.migratable), key=lambda r: (-r.priority, r.tokens, r.id)
        )
        for r in movable:
            best: InstanceView | None = None
            best_score = -math.inf
            for dest in dests:
                if dest.name == src_name or not r.served_by(dest):
                    continue
                room = room_blocks(dest.capacity_blocks, used[dest.name], reserve_blocks)
                blocks = request_blocks(r.tokens + 1, dest.block_size)  # its blocks there
                if r.running and dest.capacity_blocks > 0 and blocks > room:
                    continue
                score = instance_freeness(dest.capacity_blocks, used[dest.name], batch[dest.name])
                score += prefix_credit(r.cached.get(dest.name, 0), dest)
                if score > best_score:
                    best, best_score = dest, score
            if best is None:
                continue
            used[best.name] += request_blocks(r.tokens + 1, best.block_size)
            batch[best.name] += 1
            what = f"running request of {r.tokens} tokens" if r.running else "queued request"
            reason = f"{src_name} draining; {what}; {best.name} freeness {best_score:.1f}"
            plan.append(Migration(r.id, src_name, best.name, reason, prewarm=r.running))
    return plan


def preemption_due(src: InstanceView, running: Sequence[RequestLoad], block_size: int) -> bool:
    """Whether the source's running requests alone will soon outgrow its KV memory,
    so that the engine preempts (and later recomputes) one of them: their blocks,
    plus one more block each (what they need within about `block_size` steps),
    exceed its capacity. Queued requests (no token yet) hold no KV; they only wait."""
    queued_blocks = src.queued_tokens / block_size
    return src.virtual_blocks - queued_blocks + len(running) > src.capacity_blocks


def stalled_requests(
    src: InstanceView, candidates: Sequence[RequestLoad], settings: MigrationSettings
) -> list[RequestLoad]:
    """The source's running requests that its engine has most likely preempted,
    most silent first. vLLM puts a preempted request back in its queue, so the
    engine's waiting count exceeds the requests the ledgers have seen no token
    of (all of them, movable or not) by about the number preempted; those are
    the ones silent the longest. Moving
    one costs no extra recompute (the source would recompute it too, once it has
    memory again) and ends its stall at once."""
    if settings.stalled_after_s <= 0 or not settings.move_running:
        return []
    preempted = src.engine_preempted
    if preempted <= 0:
        return []
    silent = [
        r
        for r in candidates
        if r.running and r.migratable and r.silent_s >= settings.stalled_after_s
    ]
    return sorted(silent, key=lambda r: -r.silent_s)[:preempted]


def recompute_refusal(
    tokens: int,
    dest: InstanceView,
    settings: MigrationSettings,
    preempted: bool = False,
) -> str | None:
    """Why recomputing `tokens` (P + G) on `dest` does not pay, or None when it does:
    conditions (1)-(3) of the module docstring. A preempted request would be
    recomputed on its source anyway, so (1) does not apply to it."""
    rate = settings.prefill_tokens_per_s
    cost_s = tokens / rate
    if dest.engine_waiting > 0 and dest.queued_tokens <= 0:
        return f"{dest.name} queues {dest.engine_waiting} requests of unknown size"
    if not preempted and cost_s * (1 + dest.batch) > settings.preemption_stall_s:
        return (
            f"recompute {cost_s:.3f}s x {dest.batch + 1} streams > "
            f"{settings.preemption_stall_s:g}s preemption stall"
        )
    wait_s = (dest.queued_tokens + tokens) / rate
    if wait_s > settings.dest_ttft_slack_s:
        return f"{dest.name} queue + recompute {wait_s:.3f}s > {settings.dest_ttft_slack_s:g}s"
    return None
