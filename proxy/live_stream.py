"""A client stream that can move between instances: the owner of one live request.

The relay hands a streamed request on a migration-enabled instance to a
`LiveStream`. It relays the upstream's events through its `Splicer`, which keeps
the prompt ids P and the generated ids G. It goes on elsewhere from P + G when
- the upstream breaks or stalls (failover: the stream resumes by itself), or
- the migrator orders a move (drain, rebalance, priority; `order_move`).
A move starts the continuation first and closes the source only once the
destination has taken over, so a destination that fails costs nothing: the
source goes on. The stream holds exactly one `Call` at a time (its ledger entry
and upstream), and closes the last one when it ends. The client's stream opens
with the first bytes it is sent, as a relayed one does (proxy/relay.py `_pipe`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from migration_shim import wire
from proxy import access_log, continuation, sse, tap
from proxy.cancellation import cancelling
from proxy.errors import error_response
from proxy.metrics import FerryMetrics
from proxy.placement import Placement
from proxy.policy import Priority
from proxy.splicer import MAX_BACKOFF, Fed, Join, Splicer, plan_join
from proxy.upstream import (
    Call,
    OutOfFiles,
    Upstreams,
    answer_headers,
    encoded_against_ask,
    read_whole,
)

log = logging.getLogger("ferry.migration")

STOPPED_WAIT_S = 30.0  # full mode: how long a stopped source waits for its cut-over
# A move ordered between two tokens of a stream cuts right after the next one:
# the client's downtime is then the destination's first token alone, not also the
# part of the gap already waited out at the source. It waits at most what is left
# of CUT_WAIT_GAPS of the stream's usual gap (and CUT_WAIT_MAX_S); a stream that
# has stopped, or whose source stopped it (full mode), is cut at once.
CUT_WAIT_GAPS = 1.5
CUT_WAIT_MAX_S = 0.5


@dataclass
class MoveOrder:
    destination: str | None  # None: the policy picks
    reason: str
    load: dict[str, Any] | None = None  # full mode: KV staged at the destination
    source_stopped: bool = False  # full mode: the source's shim no longer runs it
    cut: bool = False  # its cut-over began (which frees `load` where unused)
    done: asyncio.Future[bool] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass(frozen=True)
class Request:
    """What a stream needs of the client's request to start it again anywhere."""

    id: int
    body: dict[str, Any]
    endpoint: str  # "chat" | "completions"
    path: str
    priority: Priority
    model: str
    # The request id and trace context (proxy/access_log.py), sent with every
    # continuation so the engines' logs and traces join the client's request.
    headers: dict[str, str] = field(default_factory=dict)
    # The model's context length where its first instance says (a chat without
    # a budget runs to its end; see continuation.budget).
    context: int | None = None

    @property
    def name(self) -> str:
        """How the logs name it: its request id, as its access line and the
        engines' logs do (the number is Ferry's own, for a request without one)."""
        return self.headers.get(access_log.REQUEST_ID) or f"#{self.id}"


class LiveStream:
    def __init__(
        self,
        request: Request,
        call: Call,
        splicer: Splicer,
        *,
        upstreams: Upstreams,
        placement: Placement,
        metrics: FerryMetrics,
        timing: sse.TokenTiming,
        clock: Callable[[], float],
        max_resumes: int,
        tag: str | None,
        blame: Callable[[str, str], None],
    ) -> None:
        self.request = request
        self.call = call
        self.splicer = splicer
        self.upstreams = upstreams
        self.placement = placement
        self.metrics = metrics
        self.timing = timing
        self.clock = clock
        self.max_resumes = max_resumes
        self.tag = tag  # full mode: how the source's shim finds this request
        # Holds a failure against an instance (outlier ejection): one the stream
        # broke on and left, or one a continuation could not start on.
        self.blame = blame
        self.resumes = 0
        # Instances the stream broke on: no voluntary move takes it back there (a
        # drain would otherwise bounce it onto a hung destination again and again).
        self.failed_on: set[str] = set()
        self._broke = "stream broken"  # why the current upstream broke, for `blame`
        # The current upstream gave the request up (a server error event, an
        # abort), rather than break. vLLM does so to every stream of an engine
        # that died, and to a request that makes its engine fail: the instances
        # it gave the stream up on (`_suspects`) are held to it once another
        # serves the stream, and none is where each one it tried gave it up
        # (`poison`: the request's doing; one client must not eject the fleet).
        self._gave_up = False
        self._suspects: list[tuple[str, str]] = []
        self.poison = False
        # Each cut-over that took, for the access log: from, to, reason, tokens
        # generated before it, and the downtime once the first token after it came.
        self.moves: list[dict[str, Any]] = []
        # A move of it is submitted and not over (Migrator.submit): the planners
        # leave it alone meanwhile, or a pre-warm's second would move it twice.
        self.claimed = False
        # Set once a full-mode copy of it, if one is under way, is of no use: the
        # stream failed over without it (kv_migration.KVMigrator.copy). A stream
        # that ends needs no such word: its source answers the copy at once.
        self.copy_moot = asyncio.Event()
        self._order: MoveOrder | None = None
        # What was read from the current upstream of an event not yet whole.
        self._events = sse.Events(upstreams.max_answer_bytes)
        self._pump: asyncio.Task[str] | None = None
        self._reading = False  # the pump waits for upstream bytes (safe to interrupt)
        # The pump waits for its client to take a write (it reads slowly, or not
        # at all, for up to its send timeout): a move would wait as long.
        self._writing = False
        # The client's request (`run`), and its stream once its first bytes go.
        self._client: web.Request | None = None
        self._response: web.StreamResponse | None = None
        self._ordered = asyncio.Event()
        self._source_stopped = False  # full mode: the source's shim stopped the request
        # run() returned: no one is left to carry out an order. A move that waited
        # for a slot meanwhile (Migrator._bounded) must not wait on one forever.
        self._over = False

    @property
    def instance(self) -> str:
        return self.call.instance

    @property
    def movable(self) -> bool:
        """Open to a new move: not finished, none submitted or under way, not
        waiting on a slow client (a move takes effect between writes, and would
        hold a move slot, and a drain's round, until that write is taken), and
        nothing in it that a continuation would get wrong."""
        return (
            not self.claimed
            and not self._writing
            and self.accepts_orders
            and self.splicer.unmovable is None
        )

    @property
    def waits_on_client(self) -> bool:
        """Its pump waits for its client to take a write: a move ordered now
        takes effect only once the client has (up to its send timeout)."""
        return self._writing

    @property
    def accepts_orders(self) -> bool:
        return self._order is None and not self.splicer.ended and not self._over

    def order_move(
        self,
        destination: str | None,
        reason: str,
        load: dict[str, Any] | None = None,
        *,
        source_stopped: bool = False,
        source: str | None = None,
    ) -> asyncio.Future[bool]:
        """Ask the stream to go on elsewhere; the future says whether it did.
        `source`: the instance the move was planned off; a stream no longer
        there (it failed over meanwhile) stays where it is."""
        order = MoveOrder(destination, reason, load, source_stopped)
        if not self.accepts_orders or source not in (None, self.instance):
            if load is not None:  # copied for nothing: the stream ended or moves already
                self._release_later(load["dest"], load)
            order.done.set_result(False)
            return order.done
        self._order = order
        self._ordered.set()
        if self._reading and self._pump is not None:
            wait_s = 0.0 if source_stopped else self._cut_wait_s()
            if wait_s > 0:  # the pump returns "move" once it has relayed the next token
                asyncio.get_running_loop().call_later(wait_s, self._interrupt, order)
            else:
                self._pump.cancel()  # it waits for bytes only: nothing is lost
        return order.done

    def _cut_wait_s(self) -> float:
        """How long a move ordered now waits for the stream's next token before it
        interrupts the wait: what is left of CUT_WAIT_GAPS of its usual gap (none
        if it has no pace yet; 0 or less once it is that silent, as a stopped
        stream, silent for STOPPED_GAPS of them, always is)."""
        timing = self.timing
        if timing.gap_s is None:
            return 0.0
        return min(CUT_WAIT_MAX_S, CUT_WAIT_GAPS * timing.gap_s - timing.silent_s())

    def _interrupt(self, order: MoveOrder) -> None:
        # Once the generation is over, only its usage and [DONE] are left to relay.
        if self._order is order and self._reading and self._pump is not None:
            if not self.splicer.ended:
                self._pump.cancel()

    def give_up_copy(self) -> None:
        """A full-mode copy under way is of no use now (`copy_moot`); one started
        later is a new copy."""
        moot, self.copy_moot = self.copy_moot, asyncio.Event()
        moot.set()

    def expect_source_stop(self, expected: bool) -> None:
        self.splicer.expect_source_stop = expected

    # -- driving ------------------------------------------------------------------
    async def run(self, request: web.Request) -> tuple[web.StreamResponse, str]:
        """Serve the client's `request`. Its stream opens with the first bytes
        the client is sent: until then a stream that cannot go on anywhere is
        answered with an error status, which clients retry, not with an error
        event after a 200."""
        self._client = request
        outcome = await self._run()
        response = self._response or web.Response(status=499)  # (the client left first)
        suspects, self._suspects = self._suspects, []
        if suspects and outcome == "stream_broken" and self._gave_up:
            self.poison = True
        else:
            for name, why in suspects:
                self.blame(name, why)
        return response, outcome

    async def _run(self) -> str:
        broken: tuple[str, str] | None = None  # a break a failover under way holds
        try:
            while True:
                result = await self._relay()
                if result == "done":
                    await self._end()
                    return "ok"
                # The order stays the stream's own while its cut-over runs: no
                # other is taken meanwhile, and a client gone mid-way resolves it
                # (finally, below) for the move waiting on it.
                order = self._order
                self._ordered.clear()
                refused: set[str] = set()  # destinations its move tried, that failed it
                if result == "move":
                    assert order is not None
                    moved, refused = await self._cut_over(order)
                    self._order = None
                    _settle(order, moved == "moved")
                    if moved == "done":
                        return "ok"
                    if moved == "moved" or not (self._source_stopped or order.source_stopped):
                        continue
                    # The source's shim stopped it already: resume like a broken stream.
                elif order is not None:
                    self._order = None
                    self._forgo(order)  # broken first: failover takes it over
                if self._generated_all():  # it broke after its last token: nothing to resume
                    self.splicer.finished = True
                    await self._end(self.splicer.closing())
                    return "ok"
                if self.resumes >= self.max_resumes:
                    await self._fail(self._out_of_resumes())
                    return "stream_broken"
                preferred = order.destination if order is not None else None
                self.give_up_copy()
                source, broke, gave_up = self.instance, self._broke, self._gave_up
                # A source the shim stopped for a move did not break: the stream
                # may go back there (by recompute) where no other instance takes
                # it, as when the one destination froze as it was handed over.
                stopped = self._source_stopped or (order is not None and order.source_stopped)
                self._order = failover = MoveOrder(preferred, "failover", source_stopped=stopped)
                if not stopped and not gave_up:
                    broken = (source, broke)
                moved, _ = await self._cut_over(failover, refused)
                self._order = None
                if moved == "done":
                    broken = None
                    return "ok"
                if moved != "moved":
                    why = self.splicer.unmovable or "no instance could continue"
                    await self._fail(f"failover: {why}")  # (a client gone: held below)
                    broken = None
                    return "stream_broken"  # the relay holds it against source
                broken = None
                if not stopped:
                    self.failed_on.add(source)
                    if gave_up:
                        self._suspects.append((source, broke))
                    else:
                        self.blame(source, broke)
        except ConnectionResetError:
            return "client_disconnect"
        finally:
            if broken is not None:  # the client left during the failover: the break stands
                # (Held here: the relay counts the stream a client's disconnect.)
                self.blame(*broken)
            self._over = True
            if self._order is not None:
                self._forgo(self._order)
            self.call.close()

    async def _relay(self) -> str:
        """Relay until the stream ends ("done"), breaks or stalls ("broken"), or a
        move is ordered ("move"; unread bytes stay buffered for the source)."""
        self._source_stopped = self._gave_up = False
        self._pump = asyncio.ensure_future(self._pump_events())
        try:
            result = await self._pump
        except asyncio.CancelledError:
            if self._pump.cancelled() and self._order is not None and not cancelling():
                result = "move"  # interrupted while waiting for bytes
            else:
                self._pump.cancel()
                raise
        finally:
            self._pump = None
        if result == "stopped":  # the shim stopped it: the cut-over is on its way
            self._source_stopped = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ordered.wait(), STOPPED_WAIT_S)
            result = "move" if self._order is not None else "broken"
        return result

    async def _pump_events(self) -> str:
        """Relay the current upstream's events: by a tap (proxy/tap.py) where it
        can be, in the connection's callback, else here. Either way a chunk is
        taken whole, by `_take`, and the pump returns what it says."""
        upstream = self.call.response
        assert upstream is not None
        content = upstream.content
        splicer = self.splicer
        keep_alive = sse.KeepAliveWatch(self.upstreams.stream_timeout.sock_read or 0.0, self.clock)
        outcome: str | None = None
        pump = self._pump
        # Once the client has all of the stream but its [DONE], the body's end is
        # left BODY_END_GRACE_S to come, then taken as come, as a relayed
        # stream's (proxy/relay.py `_pipe`): a server that sends no [DONE] and
        # keeps the body open held the client, and the instance's bill, until
        # `upstream_idle_timeout_s`.
        body_end = asyncio.timeout(None)

        def whole_in_grace() -> None:
            if splicer.whole and body_end.when() is None:
                body_end.reschedule(asyncio.get_running_loop().time() + sse.BODY_END_GRACE_S)

        def relay(data: bytes) -> bytes:
            # Not once the pump is cancelled (a cut, or let go): then its reads
            # are not waiting any more, and what comes stays buffered (proxy/tap.py).
            nonlocal outcome
            out, outcome = self._take(data, keep_alive)
            return out

        def wrote(out: bytes) -> None:
            if out:
                self.timing.written()
                whole_in_grace()
            if outcome is not None:
                raise _PumpOver(outcome)
            if self._order is not None and not splicer.ended and pump is not None:
                pump.cancel()  # the move waited for this token (`order_move`): cut now

        def attach(response: web.StreamResponse) -> None:
            transport = sse.client_transport(response)
            tap.attach_to(content, response, transport, relay, wrote, upstream)

        if self._response is not None:  # (else once it opens)
            attach(self._response)
        try:
            async with body_end:
                while True:
                    if self._order is not None and not splicer.ended:
                        return "move"
                    self._reading = True
                    try:
                        data = await content.readany()
                    finally:
                        self._reading = False
                    if not data:
                        break
                    out, result = self._take(data, keep_alive)
                    opening = out and self._response is None
                    await self._write(out)
                    if opening and self._response is not None:
                        attach(self._response)
                    if result is not None:
                        return result
                    if out:
                        whole_in_grace()
        except _PumpOver as over:
            # The upstream's reader keeps the exception the tap raised; its
            # frames, which hold this stream and the reader, would keep both
            # alive until a cyclic collection.
            over.__traceback__ = None
            return over.outcome
        except sse.STREAM_ERRORS as exc:
            if not body_end.expired():  # (else the grace ran out: as if the body had ended)
                log.info("stream %s on %s broke: %s", self.request.name, self.instance, _why(exc))
                self._broke = f"stream broken: {_why(exc)}"
                return "done" if splicer.finished else "broken"
        finally:
            tap.detach(content)
        self._broke = "the stream ended before it was whole"
        return "done" if splicer.finished else "broken"

    def _take(self, data: bytes, keep_alive: sse.KeepAliveWatch) -> tuple[bytes, str | None]:
        """One read of the upstream: the bytes for the client, and how the pump
        ends if it does ("done", "broken", "stopped": the source's shim stopped it)."""
        self.timing.read()
        whole = self._events.take(data)
        keep_alive.saw(whole)  # (none: bytes of an event that has not ended, no progress)
        if not whole:
            return b"", None
        splicer = self.splicer
        movable = splicer.unmovable is None
        out: list[bytes] = []
        ended = None
        for event in whole.split(b"\n\n")[:-1]:
            fed = splicer.feed(event)
            self._account(fed)
            if fed.stopped_by_source or fed.broken:
                self._events.clear()
                ended = "stopped"
                if fed.broken:
                    log.info("stream %s: %s gave it up", self.request.name, self.instance)
                    self._broke = "the stream ended with a server error"
                    self._gave_up = True
                    ended = "broken"
                break
            out.append(fed.data)
            if fed.finished:
                break
        if movable and splicer.unmovable is not None:  # (it began to reason, say)
            # Counted as a stream that could not move from the start is (relay.py).
            self.metrics.non_migratable.labels(splicer.unmovable).inc()
            log.info("stream %s cannot move from here on: %s", self.request.name, splicer.unmovable)
        return b"".join(out), ended or ("done" if splicer.finished else None)

    def _account(self, fed: Fed) -> None:
        ledger = self.call.cluster.ledger
        if fed.prompt_tokens is not None:
            ledger.set_prompt_tokens(self.call.entry, fed.prompt_tokens)
            if self.splicer.prompt_ids:  # the prefix index learns what is cached there
                self.placement.record_prompt_ids(self.call.instance, self.splicer.prompt_ids)
        if fed.tokens:
            ledger.add_generated(self.call.entry, fed.tokens)
            downtime = self.timing.token(self.instance)
            if downtime is not None and self.moves:
                self.moves[-1]["downtime_s"] = round(downtime, 6)

    async def _opened(self) -> web.StreamResponse:
        """The client's stream, opened now if it is not yet."""
        if self._response is None:
            upstream = self.call.response
            passed = None if upstream is None else answer_headers(upstream)
            assert self._client is not None  # (`run` is what writes)
            self._response = await sse.open_response(self._client, self.instance, True, passed)
        return self._response

    async def _write(self, data: bytes) -> None:
        if data:
            self._writing = True
            try:
                await sse.write(await self._opened(), data)
            finally:
                self._writing = False
            self.timing.written()

    async def _end(self, data: bytes | None = None) -> None:
        """End the stream whole; a client that misses its end raises `ClientGone`."""
        if not await sse.finish(await self._opened(), data):
            raise sse.ClientGone("the client missed the stream's end")

    # -- the cut-over ---------------------------------------------------------------
    async def _cut_over(
        self, order: MoveOrder, refused: set[str] | None = None
    ) -> tuple[str, set[str]]:
        """Start the continuation and switch to it: "moved", "failed" (the stream
        stays where it is), or "done" (nothing was left to generate); and the
        destinations tried that failed it. Never to one in `refused`; back to
        the source only in a failover from a source the shim stopped."""
        order.cut = True
        source = self.instance
        home = order.reason == "failover" and (order.source_stopped or self._source_stopped)
        tried = set(refused or ()) | (set() if home else {source})
        if order.reason != "failover":
            tried |= self.failed_on
        before = set(tried)
        try:
            result = await self._continue(order, tried)
        finally:
            self._release_unused(order, tried)
        if result == "moved":  # the source's call is over (the relay counts the last)
            # (A source Ferry's shim stopped for a move did not break.)
            stopped = self._source_stopped or order.source_stopped
            outcome = "stream_broken" if order.reason == "failover" and not stopped else "migrated"
            self.metrics.requests.labels(source, outcome).inc()
        return result, (tried - before if result == "failed" else set())

    async def _continue(self, order: MoveOrder, tried: set[str]) -> str:
        splicer = self.splicer
        source = self.instance
        if splicer.prompt_ids is None and self.timing.first_token_seen:
            self.metrics.migrations.labels(order.reason, "no_prompt_ids").inc()
            return "failed"
        if self._generated_all():
            splicer.finished = True  # the source had sent its last token
            await self._end(splicer.closing())
            return "done"
        if splicer.unmovable is not None:
            self.metrics.migrations.labels(order.reason, "not_migratable").inc()
            log.info("stream %s cannot go on elsewhere: %s", self.request.name, splicer.unmovable)
            return "failed"
        whole = False  # the join takes all of G (see `_in_step`)
        if splicer.sampled and order.reason != "failover" and not splicer.starts_over():
            # A join that steps back has the destination draw those tokens again,
            # and sampled, they differ from the ones whose text the client has
            # part of: a seam in the text. It moves only in step (no text held
            # back); failover, with nothing to wait for, takes the seam.
            whole = await self._in_step(source)
            if not whole:
                self.metrics.migrations.labels(order.reason, "not_migratable").inc()
                log.info("stream %s not moved now: sampled, its text held back", self.request.name)
                return "failed"
        self.timing.cut()
        preferred = order.destination
        generated = len(splicer.generated)  # before the cut (a start-over forgets them)
        over = splicer.starts_over()  # then the destination is sent P alone
        ids = (splicer.prompt_ids or []) + ([] if over else splicer.generated)
        cached = self.placement.cached_for(ids, source) if splicer.prompt_ids else {}
        for _ in range(2):
            tokens = len(ids) or self.call.entry.prompt_tokens
            # Its KV copied there and its source stopped, it goes where the KV
            # waits even if a drain began there meanwhile, not start over.
            staged = order.load is not None and order.load["dest"] == preferred
            # Not back where it broke while another takes it; a failover goes
            # there rather than losing the stream (`_cut_over` left those in).
            dest = None
            for exclude in (tried | self.failed_on, tried):
                dest = self.placement.destination(
                    self.request.model,
                    tokens,
                    self.request.priority,
                    exclude,
                    preferred,
                    cached,
                    rescue=order.reason == "failover",
                    reach=self.reach(),
                    staged=staged and (order.source_stopped or self._source_stopped),
                )
                if dest is not None or self.failed_on <= tried:
                    break
            if dest is None:
                self.metrics.migrations.labels(order.reason, "no_destination").inc()
                break
            tried.add(dest)
            preferred = None
            load = order.load if order.load is not None and order.load["dest"] == dest else None
            if await self._start(dest, load, cached.get(dest, 0), whole):
                self.metrics.migrations.labels(order.reason, "ok").inc()
                log.info(
                    "request %s moved %s -> %s (%s) after %d tokens",
                    self.request.name,
                    source,
                    dest,
                    order.reason,
                    generated,
                )
                if order.reason == "failover":
                    self.resumes += 1
                self.moves.append(
                    {
                        "from": source,
                        "to": dest,
                        "reason": order.reason,
                        "after_tokens": generated,
                        "downtime_s": None,
                    }
                )
                return "moved"
            self.metrics.migrations.labels(order.reason, "destination_failed").inc()
        self.timing.uncut()
        return "failed"

    def _generated_all(self) -> bool:
        """Whether the source sent the stream's last token (a finish reason, or
        the budget's last): a continuation would have nothing to generate."""
        limit = self._limit()
        return self.splicer.ended or (limit is not None and limit <= len(self.splicer.generated))

    def _release_unused(self, order: MoveOrder, tried: set[str]) -> None:
        """Free the KV a full-mode copy staged for this cut-over on a destination
        it did not try (no longer usable, or gone): a try frees its own when it
        fails (`_start`), and the stream that never goes there holds it otherwise
        until its lease runs out."""
        load = order.load
        if load is not None and load["dest"] not in tried:
            self._release_later(load["dest"], load)

    def _forgo(self, order: MoveOrder) -> None:
        """An order the stream will not carry out (it broke first, or is over):
        say so, and free the KV staged for it unless its cut-over did."""
        if order.load is not None and not order.cut:
            self._release_later(order.load["dest"], order.load)
        _settle(order, False)

    def _release_later(self, dest: str, load: dict[str, Any]) -> None:
        """Release staged KV in the background: the destination passed by may be
        the hung one, and the stream must not wait on it."""
        task = asyncio.ensure_future(self._release_kv(dest, {wire.LOAD: load}, timeout_s=2))
        _RELEASES.add(task)
        task.add_done_callback(_RELEASES.discard)

    async def _start(
        self, dest: str, load: dict[str, Any] | None, cached_tokens: int, whole: bool = False
    ) -> bool:
        """Send the stream on to `dest`; `cached_tokens` of it are probably in its
        prefix cache (the index's guess, billed as shared, not as prefill ahead);
        `whole`: from all the tokens generated, regenerating none."""
        how = ""
        try:
            how = await self._hand_over(dest, load, cached_tokens, whole)
            return bool(how)
        finally:
            # KV staged for a continuation that did not take it (it failed, the
            # client left, or the stream started over) is freed now, not when
            # its lease runs out; in the background: `dest` may be the hung one.
            if load is not None and how != "continued":
                self._release_later(dest, load)

    async def _hand_over(
        self, dest: str, load: dict[str, Any] | None, cached_tokens: int, whole: bool
    ) -> str:
        """`_start`'s work: "continued", "started over", or "" where `dest` did not
        take the stream."""
        splicer, request = self.splicer, self.request
        kv_params: dict[str, Any] = {}
        if self.upstreams.cluster.instances[dest].migration_mode == "full":
            kv_params[wire.TAG] = uuid.uuid4().hex
        join: Join | None = None
        if splicer.starts_over():
            # Nothing of the answer reached the client yet (queued, broken before
            # the first token, or its first tokens made no text): start the
            # original request over; the client sees no seam.
            path, body = request.path, {**request.body, "return_token_ids": True}
            tokens = self.call.entry.prompt_tokens
        else:
            assert splicer.prompt_ids is not None  # (else it starts over)
            join = Join(len(splicer.generated), 0) if whole else await self._plan_join(dest)
            state = self.upstreams.cluster.instances.get(dest)
            if state is None or state.leaving:
                # Removed while it was asked where to join; nothing billed it, so
                # its removal did not wait for this stream.
                log.info("continuation on %s not started: the instance is being removed", dest)
                return ""
            path = "/v1/completions"
            generated = splicer.generated[: join.keep]
            body = continuation.continuation_body(
                request.body,
                splicer.prompt_ids,
                generated,
                limit=self._limit(),
                wants_usage=splicer.wants_usage,
            )
            tokens = len(splicer.prompt_ids) + len(generated)
            if load is not None:
                # The source had the KV of its tokens but the last; the destination
                # computes at least that one itself.
                kv_params[wire.LOAD] = {
                    "mig_id": load["mig_id"],
                    "num_tokens": min(load["num_tokens"], tokens - 1),
                }
        if kv_params:
            body = {
                **body,
                "kv_transfer_params": {**(body.get("kv_transfer_params") or {}), **kv_params},
            }
        body = self.upstreams.with_priority(dest, body, request.priority)
        call = self.upstreams.begin(
            dest, request.model, request.priority, tokens, self.clock(), cached_tokens
        )
        order = self._order
        # A move whose source goes on: a destination that stops answering is
        # given up once it is seen to, whether or not another takes the model.
        source_goes_on = (
            order is not None
            and order.reason != "failover"
            and not (order.source_stopped or self._source_stopped)
        )
        try:
            upstream = await self.upstreams.send(
                call,
                "POST",
                path,
                sse.dumps(body),
                stream=True,
                headers={**request.headers, "Content-Type": "application/json"},
                fallback=source_goes_on,
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("continuation on %s failed: %s", dest, _why(exc))
            if not isinstance(exc, OutOfFiles):  # Ferry's own shortage, not dest's fault
                self.blame(dest, f"continuation failed: {_why(exc)}")
            return ""
        if upstream.status != 200:
            try:
                detail = (await read_whole(upstream, 65536))[:300]
            except (TimeoutError, aiohttp.ClientError) as exc:
                detail = _why(exc).encode()  # it broke while it answered
            finally:
                call.close()  # a client gone meanwhile too: nothing else releases it
            log.warning("continuation on %s refused: HTTP %s %s", dest, upstream.status, detail)
            if upstream.status >= 500:
                self.blame(dest, f"continuation refused: HTTP {upstream.status}")
            return ""
        if encoding := encoded_against_ask(upstream):  # its events unread (as relay.py refuses it)
            call.close()
            log.warning(
                "continuation on %s refused: its stream came with Content-Encoding %s",
                dest,
                encoding,
            )
            self.blame(dest, f"continuation refused: Content-Encoding {encoding}")
            return ""
        self.call.close()  # vLLM aborts the request on the source
        self.call = call
        self._events.clear()
        self.tag = kv_params.get(wire.TAG)
        if join is None:
            splicer.restart()
            return "started over"
        splicer.join(join)
        return "continued"

    def _limit(self) -> int | None:
        """Tokens the request may generate in all (continuation.budget)."""
        request = self.request
        prompt = len(self.splicer.prompt_ids or ())
        return continuation.budget(request.body, request.endpoint, prompt, request.context)

    def reach(self) -> int | None:
        """The longest its sequence may grow (prompt and whole budget; no longer
        than the context of the instance it began on, which cuts a budget past
        it), or None where that is not known. A destination with a shorter
        context would end it early."""
        limit = self._limit()
        if limit is None:
            return None
        prompt = len(self.splicer.prompt_ids or ()) or self.call.entry.prompt_tokens
        context = self.request.context
        return prompt + limit if context is None else min(prompt + limit, context)

    async def _in_step(self, instance: str) -> bool:
        """Whether the client has all the text of the tokens generated: no stop
        string may be forming (vLLM holds back those characters) and the text of
        G, as `instance` decodes it, is what was sent (no character held back
        half-made). A continuation from all of G then regenerates nothing."""
        splicer = self.splicer
        join, _ = splicer.join_point()
        if join.keep == len(splicer.generated) and join.skip == 0:
            return True
        if splicer.lookback:
            return False
        return await self._detokenize(instance, splicer.generated) == splicer.sent

    async def _plan_join(self, dest: str) -> Join:
        """Where the continuation starts (see `splicer.Join`): from the stream's
        own flushes, or, when vLLM merged chunks so that none is near the cut,
        from the destination's `/detokenize` of the last few prefixes of G."""
        splicer = self.splicer
        join, near = splicer.join_point()
        if near:
            return join
        generated = splicer.generated
        backs = range(min(MAX_BACKOFF, len(generated) - join.keep) + 1)
        texts = await asyncio.gather(
            *(self._detokenize(dest, generated[: len(generated) - back]) for back in backs)
        )
        found = plan_join(generated, splicer.sent, list(texts), splicer.hold, splicer.lookback)
        return found or join

    async def _detokenize(self, dest: str, tokens: list[int]) -> str | None:
        if not tokens:
            return ""
        body = {"model": self.request.model, "tokens": tokens}
        answer = await self.upstreams.post_json(dest, "/detokenize", body, timeout_s=5)
        text = answer.get("prompt") if isinstance(answer, dict) else None
        return text if isinstance(text, str) else None

    async def _release_kv(
        self, dest: str, kv_params: dict[str, Any], timeout_s: float = 10.0
    ) -> None:
        """A continuation that did not start frees the KV moved for it at once,
        rather than when its lease runs out."""
        if wire.LOAD in kv_params:
            mig_id = kv_params[wire.LOAD]["mig_id"]
            await self.upstreams.post_json(dest, wire.RELEASE, {"mig_id": mig_id}, timeout_s)

    def _out_of_resumes(self) -> str:
        """Why a stream that broke once too often ends: where it broke, each time
        (an operator looks there, not only at the last)."""
        where = ", ".join(sorted(self.failed_on | {self.instance}))
        return f"too many resumes ({self.resumes}); it broke on {where}, last: {self._broke}"

    async def _fail(self, why: str) -> None:
        message = f"stream from {self.instance} broke and could not resume: {why}"
        if self._response is None:  # the client was sent nothing: a status says it
            self._response = error_response(502, message, code="upstream_error")
            return
        # Then [DONE], as vLLM ends a stream it fails.
        error = sse.error_event(502, message, "upstream_error") + sse.DONE
        await sse.finish(self._response, error)


def _settle(order: MoveOrder, moved: bool) -> None:
    """Say how the order went, unless no one waits any more (the move's task was
    cancelled: Ferry shutting down)."""
    if not order.done.done():
        order.done.set_result(moved)


# Releases of staged KV under way (a task needs a reference until it is done).
_RELEASES: set[asyncio.Future[None]] = set()


class _PumpOver(Exception):
    """How a pump ends, when its tap read the end: raised in the pump's task."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
