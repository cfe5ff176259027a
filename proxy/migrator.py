"""The migrator: the registry of live streams and the one place moves start.

Drain, rebalance and priority ask it to move a stream (`submit`); it runs every
such move as a task in one bounded set: at most `max_concurrent` at a time, the
rest wait their turn, the moves an operator or a high-priority request asked
for (drain, priority) before rebalancing's, each class in order. A move is full
mode (KV copied through the shims) where both ends run migration_shim, else
lite (recompute, after a pre-warm of the destination's prefix cache); a
full-mode copy that does not happen falls back to lite at once, so a move never
waits on a copy that cannot finish.
Two moves do not queue, because their stream is stopped already and every
moment in a queue is a stall: failover (a stream whose upstream broke resumes at
once, by itself, in `LiveStream.run`, through the same placement) and a rescue
(a stream its engine preempted; the rescheduler plans at most as many as the
engine's queue shows, and they skip the pre-warm).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Container

from proxy.cluster import Cluster
from proxy.faults import Faults
from proxy.kv_migration import KVMigrator
from proxy.live_stream import LiveStream
from proxy.placement import Placement
from proxy.policy import InstanceView
from proxy.policy.migration import RequestLoad, plan_drain
from proxy.policy.priority import lacks_room, make_room_victims
from proxy.upstream import Upstreams

log = logging.getLogger("ferry.migration")

# A pre-warm is a prefill of P + G on the destination: well under a second where
# the destination has room. One that takes longer is queued there behind other
# work; waiting for it would hold the move (a drain, too) hostage to that queue,
# and the cut-over's recompute joins the same queue anyway. So the move goes on.
PREWARM_WAIT_S = 1.0

# How often a drain asks again for room for the streams it could not move yet.
DRAIN_RETRY_S = 0.1

# Which waiting moves take a free slot first (lower first): rebalancing is
# opportunistic, and a stream it waits behind may end before its turn.
MOVE_RANKS = {"drain": 0, "priority": 0, "rebalance": 1}
# Moves of streams stopped already (see the module docstring): every moment in
# a queue would be a stall.
_UNQUEUED = frozenset({"rescue", "failover"})

# On an instance that answers nothing (a frozen process), a stream this quiet is
# hung with it: it fails over now, not after `upstream_idle_timeout_s`. Decode
# gaps are milliseconds.
HUNG_AFTER_S = 1.0


class MoveSlots:
    """At most `size` moves at once; waiters are served by rank, then arrival."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.held = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    async def acquire(self, rank: int) -> None:
        if self.held < self.size and not self._waiting:
            self.held += 1
            return
        slot = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (rank, next(self._arrivals), slot))
        try:
            await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():
                self.release()  # handed a slot while being cancelled: pass it on
            raise

    def release(self) -> None:
        while self._waiting:
            _, _, slot = heapq.heappop(self._waiting)
            if not slot.done():  # a cancelled waiter's is done: skip it
                slot.set_result(None)  # the slot passes on: `held` stays
                return
        self.held -= 1


class Migrator:
    def __init__(
        self,
        cluster: Cluster,
        placement: Placement,
        upstreams: Upstreams,
        kv: KVMigrator,
        *,
        max_concurrent: int,
        prewarm: bool,
    ) -> None:
        self.cluster = cluster
        self.placement = placement
        self.upstreams = upstreams
        self.kv = kv
        self.prewarm = prewarm
        self.streams: dict[int, LiveStream] = {}
        # Instances drained with their streams moving off, as room for them appears
        # elsewhere (`plan_drain`); a stream that registers there later (its
        # instance was slow to answer) moves off with the rest.
        self.evacuating: set[str] = set()
        self._evacuation: asyncio.Task[None] | None = None
        self._drain_moves: dict[asyncio.Task[bool], int] = {}  # -> the request moved
        # Streams a drain move was refused for (a destination's shim out of blocks, a
        # move that broke): they finish where they are; asking again would repeat
        # the refusal every round.
        self._drain_refused: set[int] = set()
        self._drain_faults = Faults(log, "a drain round")
        self._ids = itertools.count(1)
        self._slots = MoveSlots(max(1, max_concurrent))
        self._max = max(1, max_concurrent)
        self._moves: set[asyncio.Task[bool]] = set()
        self._slotted: set[asyncio.Task[bool]] = set()  # the moves that take a slot

    def retune(self, *, max_concurrent: int, prewarm: bool) -> None:
        """New limits for moves submitted from now on (moves in flight finish as they are)."""
        self.prewarm = prewarm
        if max(1, max_concurrent) != self._max:
            self._max = max(1, max_concurrent)
            self._slots = MoveSlots(self._max)

    # -- the registry ----------------------------------------------------------------
    def next_id(self) -> int:
        return next(self._ids)

    def register(self, stream: LiveStream) -> None:
        self.streams[stream.request.id] = stream

    def unregister(self, stream: LiveStream) -> None:
        self.streams.pop(stream.request.id, None)
        self._drain_refused.discard(stream.request.id)

    def streams_on(self, instance: str) -> list[LiveStream]:
        return [s for s in self.streams.values() if s.instance == instance]

    def candidates(self, instance: str, skip: Container[int] = ()) -> list[RequestLoad]:
        """The movable streams on `instance` (but those in `skip`), as the policy
        core sees requests."""
        return [
            RequestLoad(
                s.request.id,
                s.splicer.continuation_tokens() or s.call.entry.prompt_tokens,
                s.request.priority,
                # A continuation not yet under way waits in its engine's queue: were
                # it counted as running, its silence would pass for a preemption.
                running=bool(s.splicer.generated) and not s.timing.resuming,
                cached=self._cached(s),
                silent_s=s.timing.silent_s(),
                model=s.request.model,
                short_context=self.placement.short_contexts(s.request.model, s.reach()),
            )
            for s in self.streams_on(instance)
            if s.movable and s.request.id not in skip
        ]

    def _cached(self, stream: LiveStream) -> dict[str, int]:
        """Where the prefix index places the stream's tokens (for the move's cost)."""
        ids = stream.splicer.prompt_ids
        if not ids:
            return {}
        return self.placement.cached_for(ids + stream.splicer.generated, stream.instance)

    # -- starting moves -----------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """Moves that would start at once (the rescheduler plans no more); a
        rescue takes no slot, so one in flight leaves them all free."""
        return max(0, self._max - len(self._slotted))

    def submit(
        self, stream: LiveStream, destination: str | None, reason: str, prewarm: bool = True
    ) -> asyncio.Task[bool]:
        """Move `stream` (to `destination`, or wherever placement says) in the
        background. `prewarm=False`: the source has stopped it already (preempted),
        so warming the destination first would only add to its stall."""
        stream.claimed = True
        # The move is of the stream where it is now: one that goes on elsewhere by
        # itself meanwhile (it broke, and failed over) is not moved again by it.
        source = stream.instance
        task = asyncio.create_task(self._bounded(stream, destination, reason, prewarm, source))
        task.add_done_callback(lambda _: setattr(stream, "claimed", False))
        self._moves.add(task)
        task.add_done_callback(self._moves.discard)
        if reason not in _UNQUEUED:  # see _bounded
            self._slotted.add(task)
            task.add_done_callback(self._slotted.discard)
        return task

    def drain(self, instance: str) -> int:
        """Move the live streams off `instance`, and those that arrive there, until
        `stop_draining`: each as soon as another instance has room for it (a
        first round now, then every DRAIN_RETRY_S); returns how many there are now
        that may move (none while no other instance has migration on)."""
        self.evacuating.add(instance)
        self._drain_round_guarded()
        if self._evacuation is None or self._evacuation.done():
            self._evacuation = asyncio.create_task(self._evacuate(), name="drain")
        movable = [s for s in self.streams_on(instance) if s.splicer.unmovable is None]
        streams = len(movable) if self._moves_off(instance) else 0
        partners = [n for n in self.cluster.instances if n != instance and self._moves_off(n)]
        if streams and not partners:
            # A move needs migration on at both ends (the destination runs the
            # continuation): an operator trying it on one instance sees why not.
            # (One unhealthy or draining for now may take them later.)
            log.warning(
                "drain of %s: no other instance has migration on to take its %d stream(s);"
                " they finish where they are",
                instance,
                streams,
            )
            return 0
        return streams

    def _moves_off(self, instance: str) -> bool:
        """Whether streams may be moved off `instance` by choice: its migration is
        on now. One switched off (an engine whose defaults a continuation would
        not keep) keeps the streams it began with until they end, as a drain
        leaves those of an instance that never had it; a failover still moves
        a broken one."""
        state = self.cluster.instances.get(instance)
        return state is not None and state.config.migration != "off"

    def stop_draining(self, instance: str) -> None:
        self.evacuating.discard(instance)
        self._drain_refused -= {s.request.id for s in self.streams_on(instance)}

    async def _evacuate(self) -> None:
        while self.evacuating:
            await asyncio.sleep(DRAIN_RETRY_S)
            self._drain_round_guarded()

    def _drain_round_guarded(self) -> None:
        try:
            self._drain_round()
        except Exception as exc:  # noqa: BLE001 - a drain must outlive one round
            # A bug or state no check foresaw loses this round, not the drain.
            self._drain_faults.failed(exc)
        else:
            self._drain_faults.ok()

    def _drain_round(self) -> None:
        """Plan and submit the moves off the draining instances that fit now. A round
        waits for the last one's moves to land: until they do, the ledger does not
        count them on their destinations, so their room would be given twice. Not
        for a move whose stream waits on its client, though: it takes effect at
        the stream's next write, which a client that reads nothing holds for its
        send timeout, and one such client must not hold every other drain."""
        for request_id in self._drain_moves.values():
            stream = self.streams.get(request_id)
            if stream is not None and not stream.waits_on_client:
                return
        skip = self._drain_refused | set(self._drain_moves.values())
        requests = {n: self.candidates(n, skip=skip) for n in self.evacuating if self._moves_off(n)}
        if not any(requests.values()):
            return
        view = self.placement.view_of(self.placement.migration_instances() | self.evacuating)
        for move in plan_drain(view, requests):
            log.info(
                "drain: request %s %s -> %s: %s",
                move.request_id,
                move.source,
                move.destination,
                move.reason,
            )
            stream = self.streams[move.request_id]
            task = self.submit(stream, move.destination, "drain", move.prewarm)
            self._drain_moves[task] = move.request_id
            task.add_done_callback(self._drain_moved)

    def _drain_moved(self, task: asyncio.Task[bool]) -> None:
        request_id = self._drain_moves.pop(task)
        refused = task.cancelled() or task.exception() is not None or not task.result()
        stream = self.streams.get(request_id)
        # (Not one whose drain was called off meanwhile, which is why it did not
        # move: drained again, it would be passed over for good.)
        if refused and stream is not None and stream.instance in self.evacuating:
            self._drain_refused.add(request_id)

    def leave_hung(self, instance: str) -> int:
        """`instance` answers nothing (proxy/scraper.py `on_down`: a frozen
        process): fail over its streams quiet for HUNG_AFTER_S (a first token not
        come counts from the arrival), and give up the relay's calls waiting that
        long on it (an answer, a stream's next bytes): each is tried elsewhere
        where nothing reached its client, and ends with an error event where
        something did. Returns how many. Those whose model no other instance
        serves now wait on: given up, a call would be a 503 and a failover find
        nowhere, where the instance thawed would answer them. A draining instance
        counts (a failed call or a broken stream is taken there where no other
        is left; a stream only with migration on), one being removed does not;
        a move's continuation is given up wherever (its stream goes on)."""
        cluster = self.cluster
        others = [
            state
            for name, state in cluster.instances.items()
            if name != instance
            and state.healthy
            and not state.leaving
            # (Ejected, a draining one takes nothing: no rescue goes there.)
            and not (state.draining and cluster.ejected_for(name))
        ]

        def elsewhere(model: str | None, stream: bool = False) -> bool:
            return any(
                (model is None or model in state.models)
                and not (stream and state.draining and state.config.migration == "off")
                for state in others
            )

        hung = [
            s
            for s in self.streams_on(instance)
            if s.timing.quiet_s() >= HUNG_AFTER_S and elsewhere(s.request.model, stream=True)
        ]
        for stream in hung:
            if stream.claimed:
                # A move under way may wait on this instance for the stream's KV
                # (full mode), which it will not give: the copy is given up, and
                # the next look fails the stream over.
                stream.give_up_copy()
                continue
            log.info("stream %s quiet on unhealthy %s: failing over", stream.request.name, instance)
            self.submit(stream, None, "failover", prewarm=False)
        waits = self.upstreams.waits.give_up(instance, HUNG_AFTER_S, elsewhere)
        if waits:
            log.info("%d call(s) waiting on unhealthy %s given up", waits, instance)
        return len(hung) + waits

    def make_room(self, chosen: InstanceView, blocks_needed: int) -> bool:
        """A high-priority request goes to `chosen`: move lower ones off if it
        does not fit (the decision is the policy core's `make_room_victims`)."""
        if not lacks_room(chosen, blocks_needed):  # (the common case: no candidates read)
            return False
        movable = self.placement.migration_instances()
        if chosen.name not in movable:
            return False
        elsewhere = self.placement.view_of(movable).instances
        candidates = self.candidates(chosen.name)
        victims = make_room_victims(chosen, blocks_needed, candidates, elsewhere)
        for victim in victims:
            # No pre-warm: the high-priority request waits here for the room, and
            # a pre-warm holds the cut-over up to PREWARM_WAIT_S (on a full
            # destination, which is where a victim goes, all of it).
            self.submit(self.streams[victim], None, "priority", prewarm=False)
        return bool(victims)

    async def stop(self) -> None:
        self.evacuating.clear()
        if self._evacuation is not None:
            self._evacuation.cancel()
            await asyncio.gather(self._evacuation, return_exceptions=True)
        for task in self._moves:
            task.cancel()
        await asyncio.gather(*self._moves, return_exceptions=True)

    async def _bounded(
        self, stream: LiveStream, destination: str | None, reason: str, prewarm: bool, source: str
    ) -> bool:
        if reason in _UNQUEUED:  # stopped already: no queue (see the module docstring)
            return await self.move(stream, destination, reason, prewarm, source)
        slots = self._slots  # a retune replaces it; this move releases the one it took
        await slots.acquire(MOVE_RANKS.get(reason, 1))
        try:
            return await self.move(stream, destination, reason, prewarm, source)
        finally:
            slots.release()

    async def move(
        self,
        stream: LiveStream,
        destination: str | None,
        reason: str,
        prewarm: bool = True,
        source: str | None = None,
    ) -> bool:
        """Move one live stream now, off `source` (where it is, by default);
        False when it stays where it is, or is no longer there."""
        source = stream.instance if source is None else source
        if not stream.accepts_orders or stream.splicer.unmovable is not None:
            return False
        if not self._still_wanted(reason, source) or stream.instance != source:
            return False
        # Where it broke before is no place to send it (LiveStream.failed_on):
        # a failover goes back to one only where no other takes it (its cut-over).
        avoid = {source} | stream.failed_on
        if destination is not None and (
            not self.placement.takes_moves(destination) or destination in avoid
        ):
            destination = None  # removed, drained, ejected or reconfigured while it waited
        if destination is None:  # resolve now, so the destination can be pre-warmed
            destination = self.placement.destination(
                stream.request.model,
                stream.splicer.continuation_tokens() or stream.call.entry.prompt_tokens,
                stream.request.priority,
                avoid,
                reach=stream.reach(),
            )
        if destination is None:
            return await stream.order_move(None, reason, source=source)
        # A stream that starts over (nothing of it shown yet) needs no KV copied,
        # and one failing over has none to be had: its source stopped answering.
        # Nor is a sampled one's: its move goes only in step, with no text held
        # back (LiveStream._in_step), and the copy's stop lands where it may be
        # held back (a character's bytes cut between tokens, each few tokens of
        # Chinese), past going back: the stream would resume with a seam. By
        # recompute the cut is Ferry's, between chunks, and one out of step stays.
        if (
            reason != "failover"
            and stream.tag
            and not stream.splicer.starts_over()
            and not stream.splicer.sampled
            and self.kv.applies(source, destination)
        ):
            return await self._move_kv(stream, source, destination, reason)
        if self.prewarm and prewarm:
            await self._prewarm(stream, destination)
            if not self._still_wanted(reason, source):
                return False
        return await stream.order_move(destination, reason, source=source)

    def _still_wanted(self, reason: str, source: str) -> bool:
        """Whether a move for `reason` off `source` is still wanted: a drain
        called off (undrained) while its move waited for a slot or its pre-warm
        moves nothing; one whose migration was switched off moves nothing by
        choice. A failover is always wanted."""
        if reason == "failover":
            return True
        return self._moves_off(source) and (reason != "drain" or source in self.evacuating)

    async def _move_kv(
        self, stream: LiveStream, source: str, destination: str, reason: str
    ) -> bool:
        assert stream.tag is not None
        outcome = await self.kv.copy(
            source,
            destination,
            stream.tag,
            stream.splicer.continuation_tokens(),
            reason,
            stream.expect_source_stop,
            stream.copy_moot,
        )
        if outcome.finished or outcome.refused or outcome.abandoned:
            return False
        # Not copied (the request was queued or preempted, the copy failed or
        # timed out): move it by recompute at once instead.
        return await stream.order_move(
            destination, reason, outcome.load, source_stopped=outcome.stopped, source=source
        )

    async def _prewarm(self, stream: LiveStream, destination: str) -> None:
        """Lite pre-copy: P + G0 as a one-token request, so the destination's prefix
        cache holds those blocks while the source keeps decoding."""
        splicer, request = stream.splicer, stream.request
        if splicer.prompt_ids is None:
            return
        ids = splicer.prompt_ids + splicer.generated
        body = {"model": request.model, "prompt": ids, "max_tokens": 1}
        if "cache_salt" in request.body:
            body["cache_salt"] = request.body["cache_salt"]
        body = self.upstreams.with_priority(destination, body, request.priority)
        # An optimisation only: if it fails or is slow, the cut-over recomputes instead.
        # A slow one is expected under load: give up on it quietly (cancelling the
        # call closes its connection, and the engine aborts the request). Give up
        # too when the stream stops while it waits: a pre-warm pays by overlapping
        # the source's decoding, and a source short of memory may preempt the very
        # stream being moved; waiting on would only lengthen its stall.
        # The pre-warm is billed to the destination while it runs: it queues a
        # prefill of P + G there, and the destination is the freest instance by
        # choice, where the next arrivals go too. Unbilled, a burst would pile onto
        # it behind this prefill (and its engine's queue would outgrow what the
        # ledger has waiting there, which reads as preempted streams).
        cached = self._cached(stream).get(destination, 0)
        bill = self.upstreams.begin(
            destination, request.model, request.priority, len(ids), stream.clock(), cached
        )
        warm = asyncio.ensure_future(
            self.upstreams.post_json(destination, "/v1/completions", body, timeout_s=30)
        )
        deadline = asyncio.get_running_loop().time() + PREWARM_WAIT_S
        try:
            while not warm.done() and not stream.timing.stopped():
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                # Wake when the stream would count as stopped; a token in between
                # only moves that later, so look again then.
                await asyncio.wait({warm}, timeout=min(left, stream.timing.stops_in()))
        finally:
            warm.cancel()  # a no-op when it is done; post_json raises nothing else
            bill.close()
