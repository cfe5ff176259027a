"""Several Ferry processes, one cluster view, through Redis.

Every `publish_interval_s` (50 ms) each process makes one round trip, a MULTI
pipeline that:
- writes its record (proxy/peer_load.py) to `<prefix>:load:<process>` with a
  TTL of `ttl_s`, so that a process killed without a word stops counting
  within the TTL, and joins the member set `<prefix>:members`;
- reads the records of the members it knew last round (a new member is seen
  one round later; a member whose record expired is dropped from the set);
- reads the fleet changes (`<prefix>:fleet`, a Redis stream) it has not seen:
  drain, undrain, add, remove and patch made through any process's admin API,
  and the instances a process's reload decided (`file`: nothing to apply);
- takes the moves the rescheduler lease holder sent it (`<prefix>:moves:<process>`);
- takes or renews the rescheduler lease (`<prefix>:lease`, a key with expiry
  `lease_ttl_s` holding its holder's name), if it rebalances;
- once a second, writes its Prometheus exposition to
  `<prefix>:metrics:<group>:<process>` (expiring after `METRICS_TTL_S`), the
  group being its host and port: a scrape of that port reaches one of the
  processes serving it (`--workers`), which answers for all of them
  (`merged_metrics`, proxy/metrics_merge.py). Replicas on other hosts are
  scraped apart, so each answers for its own.

Between rounds, a dispatch or a release is announced at once on the channel
`<prefix>:changes` (Redis pub/sub; at most one message per `change_interval_s`,
5 ms, carrying every instance whose counts changed), and each process listens
there: a peer's placements reach the view in milliseconds, not in one or two
rounds (proxy/peer_load.py says why that matters). A lost message costs nothing
lasting: the next record carries the same totals.

The fleet log keeps the last `fleet_log_length` changes. With each change the
process that made it also rewrites that instance's compacted changes in the hash
`<prefix>:fleet:state` (proxy/fleet.py's `compact`: at most an add, a remove or
a reload's `file`, one merged patch, and the last drain or undrain), in the
same transaction. A process
that starts applies the hash, not the log; one that finds the log trimmed past
the last change it applied (it was cut off from Redis that long) does the same.

Each process also keeps the compacted changes it applied, and Redis a random
`<prefix>:epoch`, set by the first round that finds none. An epoch that changes
under a process says Redis lost its data (restarted without persistence,
flushed): the hash is empty, and a process that starts now would not know of a
drain made before. So each process that sees it writes back what it holds,
merged in time order (each change carries its maker's wall-clock time) with
what the hash holds by then, and appends a `resync` to the log: every process,
the one started meanwhile too, applies the hash again.

Redis is a shared blackboard, not a dependency of each request: a request
reads the view in memory, never Redis. If Redis cannot be reached the process
goes on alone: after `ttl_s` without a good round its peers' totals are
forgotten (they may be dead) and after `lease_ttl_s` it stops rebalancing (it
cannot know that it still holds the lease). The first round must succeed:
a wrong URL fails the start, not the afternoon.

Contract: `await start()` makes the first two rounds (so the first request sees
the peers and every fleet change made before this process started) and starts
one task; `await stop()` cancels it, deletes this process's record and gives the
lease back, so a graceful stop leaves no load behind even for the TTL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from proxy import blocking_io
from proxy.cancellation import cancelling
from proxy.cluster import Cluster
from proxy.config import SharingConfig
from proxy.faults import Faults
from proxy.fleet import Fleet, FleetError, compact, op_instance, patch_times
from proxy.metrics_merge import merge
from proxy.migrator import Migrator
from proxy.peer_load import (
    BadRecord,
    LoadChange,
    PeerLoads,
    ProcessRecord,
    decode,
    decode_change,
    encode,
    encode_change,
    fleet_print,
)
from proxy.policy.migration import RequestLoad
from proxy.rescheduler import Rescheduler

log = logging.getLogger("ferry.sharing")

METRICS_EVERY_S = 1.0  # how often a process publishes its exposition
METRICS_TTL_S = 3 * METRICS_EVERY_S  # a dead process's counters leave the sum after this
# A peer whose instance table differs from this one's this long is told of in
# the log: shorter differences are a fleet change or a reload on its way.
FLEET_MISMATCH_S = 5.0
SETTLE_TIMEOUT_S = 2.0  # the longest an admin change waits for its round (`Sharing.settle`)

# Take the lease when nobody holds it, renew it when we do: atomically, so two
# processes never both believe they hold it. A process that does not rebalance
# (ARGV[3] "0": its rebalance_interval_s is 0) gives it back and never takes
# it: held there, it would stop every process's rebalancing.
# A write Redis runs later than ARGV's deadline (ms, its own clock; '' for none)
# is dropped: a round sent to a Redis that hung, and run when it resumed, would
# bring back a process that died meanwhile (its load, its lease) for a TTL more.
_LATE = """
if redis.replicate_commands then redis.replicate_commands() end  -- (Redis < 5: TIME, then writes)
local function late(deadline)
  if deadline == '' then return false end
  local now = redis.call('TIME')
  return now[1] * 1000 + math.floor(now[2] / 1000) > tonumber(deadline)
end
"""
_SET_UNLESS_LATE = (
    _LATE
    + """
if late(ARGV[3]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
)
_TAKE_OR_RENEW = (
    _LATE
    + """
local holder = redis.call('GET', KEYS[1])
if late(ARGV[4]) then return 0 end
if ARGV[3] == '0' then
  if holder == ARGV[1] then redis.call('DEL', KEYS[1]) end
  return 0
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
)
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class SharingUnavailable(RuntimeError):
    """Redis could not be reached when the process started."""


def process_name() -> str:
    """A name no other process has, now or later: host, pid, and a random tail
    (a pid is reused after a restart, and a dead process's record may linger)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Sharing:
    def __init__(
        self,
        client: aioredis.Redis,
        settings: SharingConfig,
        cluster: Cluster,
        fleet: Fleet,
        migrator: Migrator,
        rescheduler: Rescheduler,
        *,
        name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = client
        self.settings = settings
        self.cluster = cluster
        self.fleet = fleet
        self.migrator = migrator
        self.rescheduler = rescheduler
        self.name = name or process_name()
        self.clock = clock
        prefix = settings.key_prefix
        self._members_key = f"{prefix}:members"
        self._fleet_key = f"{prefix}:fleet"
        self._fleet_state_key = f"{prefix}:fleet:state"
        self._epoch_key = f"{prefix}:epoch"
        self._lease_key = f"{prefix}:lease"
        self._load_prefix = f"{prefix}:load:"
        self._moves_key = f"{prefix}:moves:{self.name}"
        self._changes_key = f"{prefix}:changes"
        self._metrics_prefix = f"{prefix}:metrics:"
        # This process's exposition, published for the processes serving the same
        # host and port (both set by the server): called on the loop, it sets the
        # gauges and returns what renders the text (run in a thread).
        self.exposition: Callable[[], Callable[[], bytes]] | None = None
        self.metrics_group = socket.gethostname()
        self._metrics_at = -math.inf  # clock() of the last publish
        self._peer_metrics: list[str] = []  # the peers' expositions, as last read
        self._differ_since: dict[str, float] = {}  # peers whose instance table differs
        self._differ_told: set[str] = set()  # ... and have been told of
        self.peers = PeerLoads()
        self.lease_holder: str | None = None
        self._members: list[str] = []
        self._fleet_seen = "0"  # the last fleet change applied (a stream id)
        self._resync_due = True  # apply the compacted fleet state next round
        # Each instance's compacted changes as applied here: written back if Redis
        # loses them (the epoch changes).
        self._fleet_state: dict[str, list[dict[str, Any]]] = {}
        # Where the workers of one `--workers` parent keep the compacted fleet
        # state as they hold it (proxy/workers.py): one started again while
        # Redis is down begins from it, not from the file alone.
        self.snapshot_path: str | None = None
        self._snapshot_due = False
        self._adopting: set[asyncio.Task[None]] = set()  # (`_in_background`)
        # A peer's add of a name whose instance here is still being removed: it,
        # and the changes to that name read after it, wait for the removal.
        self._held: dict[str, list[tuple[dict[str, str], tuple[int, int] | None]]] = {}
        self._epoch: str | None = None  # Redis's, as last read
        self._restore_due = False
        # Moves to send: (owner, id, destination, prewarm, reason, source).
        self._outbox: list[tuple[str, int, str, bool, str, str]] = []
        self._announced: list[dict[str, Any]] = []  # fleet changes made here, to send
        # The fleet log orders every change, and every process must end as applying
        # it in that order would leave it. A change made here was applied at once,
        # so a peer's change read later but logged before it was applied out of
        # order: its instance is then `_rebase`d, this process's own changes to it
        # made again as the log brings them. `_own_last`: where the last change
        # made here to each instance sits in the log.
        self._own_last: dict[str, tuple[int, int]] = {}
        self._rebase: set[str] = set()
        self._gone: list[str] = []  # members whose records expired, to drop from the set
        self._member_bytes: dict[str, Any] = {}  # each member's name as Redis holds it
        self._last_round: float | None = None  # clock() of the last good round
        # Redis's clock less time.monotonic(), in ms, as the last round read it
        # (None before one did): its writes' deadlines are in Redis's time.
        self._redis_offset_ms: float | None = None
        self._lease_until = -1.0  # clock() until which the lease is surely ours
        self._failing = False
        self._faults = Faults(log, "a sharing round")
        self._task: asyncio.Task[None] | None = None
        # One round at a time: the loop's, or one an admin change asks for (`settle`).
        self._rounds = asyncio.Lock()
        self._listener: asyncio.Task[None] | None = None
        # Count changes made here (dispatches, releases), and those not yet announced.
        self._seq = 0
        self._dirty: set[str] = set()
        self._announcing: asyncio.Task[None] | None = None

    # -- the contract ---------------------------------------------------------------
    async def start(self, alone_ok: bool = False) -> None:
        """Join the shared view; SharingUnavailable if Redis cannot be reached,
        unless `alone_ok` (a worker started again while Redis is down, beside
        workers that carry on alone): it serves alone and joins once Redis is back."""
        self.fleet.announce = self._announce
        self.rescheduler.coordinator = self
        self.cluster.ledger.on_count = self._counted
        self.cluster.shared = True
        try:
            # Two rounds: the first learns who the peers are, the second reads them.
            await self.round()
            await self.round()
        except (RedisError, OSError) as exc:
            if not alone_ok:
                raise SharingUnavailable(
                    f"cannot share the cluster view through Redis: {exc}"
                ) from exc
            self._went_wrong(exc)
            self._apply_snapshot()
        self._task = asyncio.create_task(self._run(), name="sharing")
        self._listener = asyncio.create_task(self._listen(), name="sharing-changes")

    async def stop(self) -> None:
        self.cluster.ledger.on_count = None
        tasks = [t for t in (self._task, self._listener, self._announcing) if t is not None]
        tasks += self._adopting
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = self._listener = self._announcing = None
        self._lease_until = -1.0
        try:
            await self._flush_announced()  # a change made just before the stop
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(self._load_prefix + self.name, self._moves_key)
            pipe.delete(self._metrics_key(self.name))
            pipe.srem(self._members_key, self.name)
            await pipe.execute()
            await self.redis.eval(_RELEASE, 1, self._lease_key, self.name)
        except (RedisError, OSError) as exc:
            log.warning("could not withdraw from the shared view (it expires by itself): %s", exc)

    # -- what the rescheduler asks (proxy/rescheduler.py's Coordinator) -------------
    def holds_lease(self) -> bool:
        return self.clock() < self._lease_until

    def peer_candidates(self) -> Mapping[str, Mapping[str, Sequence[RequestLoad]]]:
        return {name: record.candidates for name, record in self.peers.records.items()}

    def send_move(
        self,
        owner: str,
        request_id: int,
        destination: str,
        prewarm: bool,
        reason: str,
        *,
        source: str,
    ) -> None:
        self._outbox.append((owner, request_id, destination, prewarm, reason, source))

    def health(self) -> tuple[bool, bool, int]:
        """Whether Redis answers, whether this process holds the lease, and how
        many peers it reads (`ferry_sharing_*`)."""
        return not self._failing, self.holds_lease(), len(self.peers.records)

    def unshared(self) -> str | None:
        """Why a fleet change made here now would reach no other process (Redis
        is unreachable), or None."""
        return "Redis is unreachable from this process" if self._failing else None

    async def settle(self) -> None:
        """A round now, under SETTLE_TIMEOUT_S: the fleet changes made here go into
        the fleet log, and the others' made so far are applied here. An admin
        change waits for it, so that its answer means every process will see it
        and a change that follows it through another process finds what it made
        (a removal right after an add through another worker was a 404 a third of
        the time). Redis failing or slow: the change goes with a later round."""
        try:
            async with asyncio.timeout(SETTLE_TIMEOUT_S), self._rounds:
                await self.round()
        except Exception as exc:  # noqa: BLE001 - Redis, a timeout, a round's fault: the loop's
            log.debug("a fleet change waits for a later round: %s", exc)

    def _announce(self, op: dict[str, Any]) -> None:
        """A fleet change made here: the peers get it next round."""
        name = op_instance(op)
        if op["op"] == "file" and name is not None:
            pending = any(op_instance(o) == name for o in self._announced)
            told = [e["op"] for e in self._fleet_state.get(name, [])]
            # Nothing to forget: never changed at runtime, or only drained since
            # the file last decided it as it does now.
            if not pending and all(o["op"] in ("drain", "undrain") or o == op for o in told):
                return
        self._announced.append(op)

    # -- the rounds -----------------------------------------------------------------
    async def _run(self) -> None:
        # redis-py can swallow a cancel that lands inside a call (seen: stop()
        # waited forever on a round loop that went on), so the loops end on the
        # cancel request itself, not on the CancelledError.
        while not cancelling():
            await asyncio.sleep(self.settings.publish_interval_s)
            try:
                async with self._rounds:
                    await self.round()
            except (RedisError, OSError) as exc:
                self._went_wrong(exc)
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any one round
                # Data no check foresaw (another writer's keys) or a bug: this round
                # is lost, not the sharing.
                self._faults.failed(exc)
            else:
                self._faults.ok()
            if self._snapshot_due and self.snapshot_path is not None:
                self._snapshot_due = False
                await _write_snapshot(self.snapshot_path, json.dumps(self._fleet_state))

    async def round(self) -> None:
        """One exchange with Redis; raises RedisError or OSError if it fails."""
        fleet = self._fleet_print()
        record = ProcessRecord(
            self.name,
            {name: self.cluster.local_load(name) for name in self.cluster.instances},
            {n: tuple(loads) for n, loads in self.rescheduler.local_candidates().items()},
            self._seq,
            fleet,
        )
        ttl_ms = int(self.settings.ttl_s * 1000)
        lease_ms = int(self.settings.lease_ttl_s * 1000)
        exposition = None
        if self.exposition is not None and self.clock() - self._metrics_at >= METRICS_EVERY_S:
            # Its text rendered off the event loop: at a thousand instances it
            # takes 0.1 s. (Its gauges are set here: they read the loop's state.)
            exposition = await asyncio.to_thread(self.exposition())
        if self._restore_due:
            await self._restore()
        if self._resync_due:
            await self._resync()
        await self._flush_announced()
        outbox, self._outbox = self._outbox, []
        if not self.holds_lease():
            # Planned while it held the lease; another may hold it now and plan
            # anew (the owner would drop a move of a stream gone elsewhere, but
            # not one merely out of date).
            outbox = []
        gone, self._gone = self._gone, []
        known = [m for m in self._members if m != self.name]
        started = self.clock()
        sent = time.monotonic()
        deadline = ""  # (a write later than a TTL past this would be stale as it lands)
        if self._redis_offset_ms is not None:
            deadline = str(int(sent * 1000 + self._redis_offset_ms) + ttl_ms)
        pipe = self.redis.pipeline(transaction=True)
        # Answers read by position: these twelve (and SREM's), the records, then writes.
        pipe.eval(
            _SET_UNLESS_LATE, 1, self._load_prefix + self.name, encode(record), ttl_ms, deadline
        )
        pipe.sadd(self._members_key, self.name)
        if gone:  # before SMEMBERS, which then no longer names them
            pipe.srem(self._members_key, *(self._member_bytes.get(g, g) for g in gone))
        pipe.smembers(self._members_key)
        pipe.xrange(self._fleet_key, count=1)  # the oldest change kept: was one trimmed unseen?
        pipe.xrange(self._fleet_key, min=f"({self._fleet_seen}", count=100)
        pipe.lrange(self._moves_key, 0, -1)
        pipe.delete(self._moves_key)
        plans = "1" if self.rescheduler.interval_s > 0 else "0"
        pipe.eval(_TAKE_OR_RENEW, 1, self._lease_key, self.name, lease_ms, plans, deadline)
        pipe.get(self._lease_key)
        pipe.setnx(self._epoch_key, secrets.token_hex(8))  # new each time: never the lost one
        pipe.get(self._epoch_key)
        pipe.xrevrange(self._fleet_key, count=1)  # the newest change: older after a rollback
        if known:
            pipe.mget([self._load_prefix + m for m in known])
        # Once a second, this process's exposition, and the peers' read back: what
        # a scrape sums while Redis is down.
        if exposition is not None and known:
            pipe.mget([self._metrics_key(m) for m in known])
        if exposition is not None:
            self._metrics_at = started
            ttl = int(METRICS_TTL_S * 1000)
            pipe.set(self._metrics_key(self.name), exposition, px=ttl)
        pipe.time()
        for owner, request_id, destination, prewarm, reason, source in outbox:
            key = f"{self.settings.key_prefix}:moves:{owner}"
            pipe.rpush(key, json.dumps([request_id, destination, prewarm, reason, source]))
            pipe.pexpire(key, ttl_ms)  # a dead owner's moves go with it
        try:
            results = await pipe.execute()
        except BaseException:
            # (Moves are planned again by then; resending them could move a stream twice.)
            self._gone[:0] = gone
            raise
        self._last_round = started
        if gone:
            del results[2]  # SREM's answer
        # TIME's answer, taken as read when the round was sent: Redis ran it later,
        # so a late answer (a busy loop) errs towards later deadlines, never drops.
        seconds, micros = results[-1 - 2 * len(outbox)]
        self._redis_offset_ms = seconds * 1000 + micros / 1000 - sent * 1000
        _, _, members, oldest, changes, moves, _, held, holder, _, epoch, newest = results[:12]
        texts = results[12] if known else []
        if exposition is not None and known:
            self._peer_metrics = [_text(t) for t in results[13] if t is not None]
        if not self._check_epoch(None if epoch is None else _text(epoch)):
            self._check_rollback(_stream_id(newest[0][0]) if newest else (0, 0))
        # (A name that is not UTF-8 is no process's: read with replacement, it has
        # no record, so it is dropped as gone, by the bytes it was stored as.)
        self._member_bytes = {_text(m): m for m in members}
        self._read(set(self._member_bytes), dict(zip(known, texts, strict=True)), fleet)
        # From the round's start: the lease was renewed no earlier than that.
        self._lease_until = started + self.settings.lease_ttl_s if held else -1.0
        self.lease_holder = None if holder is None else _text(holder)
        seen = self._fleet_seen
        if seen != "0" and oldest and _stream_id(oldest[0][0]) > _stream_id(seen):
            # Changes this process never read were trimmed: start over from the state.
            log.warning("fleet log trimmed past the last change applied here: resyncing")
            self._resync_due = True
            changes = []
        for change_id, fields in changes:
            self._fleet_seen = _text(change_id)
            self._apply_change(
                {_text(k): _text(v) for k, v in fields.items()}, _stream_id(change_id)
            )
        for op in self._announced:  # made here, not in the log yet: it will come last
            if op_instance(op) in self._rebase:
                self._apply_own(op)
        for raw in moves:
            self._apply_move(_text(raw))

    def _read(self, members: set[str], texts: dict[str, Any], fleet: str) -> None:
        """Take the peers' records; a member whose record expired is gone. `fleet`:
        this process's instance table's fingerprint, as it published it."""
        records: dict[str, ProcessRecord] = {}
        for member, text in texts.items():
            if text is None:  # expired: that process died
                members.discard(member)
                continue
            try:
                records[member] = decode(text)
            except BadRecord as exc:
                log.warning("ignoring the record of %s: %s", member, exc)
        gone = sorted(set(texts) - members)
        if gone:
            log.info("peers gone (their totals expired): %s", ", ".join(gone))
            self._gone += gone  # dropped from the member set next round
        self._members = sorted(members)
        self._compare_fleets(records, fleet)
        self.peers.take_records(records)
        self.cluster.set_peer_load(self.peers.totals())
        if self._failing:
            log.info("Redis reachable again: sharing the view")
            self._failing = False

    def _fleet_print(self) -> str:
        """The fingerprint of the instances this process lists: not those on their
        way out (each process keeps one until its own streams end), nor those
        DNS discovery found (each process resolves on its own clock)."""
        discovered = self.fleet.discovered
        return fleet_print(
            {
                name: state.url
                for name, state in self.cluster.instances.items()
                if not state.leaving and name not in discovered
            }
        )

    def _compare_fleets(self, records: Mapping[str, ProcessRecord], own: str) -> None:
        """Tell of peers whose instance table has differed from this one's for
        FLEET_MISMATCH_S (once each time it starts to): names are how processes
        share load and drains, so a name that is another server on a peer
        gets this one's load, and a name it lacks, none of its drains."""
        now = self.clock()
        differing = {p for p, r in records.items() if r.fleet and r.fleet != own}
        for peer in set(self._differ_since) - differing:
            del self._differ_since[peer]
            self._differ_told.discard(peer)
        for peer in differing:
            since = self._differ_since.setdefault(peer, now)
            if now - since >= FLEET_MISMATCH_S and peer not in self._differ_told:
                self._differ_told.add(peer)
                log.warning(
                    "%s has other instances (names or URLs) than this process for %.0f s:"
                    " processes sharing a view must list the same ones (keep their"
                    " files the same)",
                    peer,
                    now - since,
                )

    # -- count changes, announced between rounds --------------------------------------
    def _counted(self, instance: str) -> None:
        """The ledger's hook: a request came or went on `instance`."""
        self._seq += 1
        self._dirty.add(instance)
        if self._announcing is None:
            self._announcing = asyncio.get_running_loop().create_task(self._announce_changes())

    async def _announce_changes(self) -> None:
        """Publish the dirty instances' totals, at most once per `change_interval_s`
        (a burst of dispatches goes out as one message)."""
        try:
            while self._dirty:
                dirty, self._dirty = self._dirty, set()
                known = dirty & self.cluster.instances.keys()  # not one removed meanwhile
                loads = {n: self.cluster.local_load(n) for n in known}
                change = LoadChange(self.name, self._seq, loads)
                await self.redis.publish(self._changes_key, encode_change(change))
                await asyncio.sleep(self.settings.change_interval_s)
        except (RedisError, OSError) as exc:
            log.debug("a load change was not announced (the next round carries it): %s", exc)
        finally:
            self._announcing = None

    async def _listen(self) -> None:
        """Take the peers' announced changes as they come; resubscribe after an outage."""
        while not cancelling():
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(self._changes_key)
                    while not cancelling():
                        message = await pubsub.get_message(
                            ignore_subscribe_messages=True, timeout=self.settings.ttl_s
                        )
                        if message is not None:
                            self._take_change(message["data"])
            except (RedisError, OSError) as exc:
                log.debug("change channel lost, subscribing again: %s", exc)
                await asyncio.sleep(self.settings.publish_interval_s)

    def _take_change(self, data: Any) -> None:
        try:
            change = decode_change(data)
        except BadRecord as exc:
            log.warning("ignoring a load change: %s", exc)
            return
        if change.process != self.name and self.peers.take_change(change):
            self.cluster.set_peer_load(self.peers.totals())

    def _apply_change(self, fields: dict[str, str], at: tuple[int, int] | None = None) -> None:
        """One change from the fleet log (at its position `at`) or the compacted state."""
        origin = fields.get("origin")
        if origin == self.name:  # made here already
            if at is not None:
                self._own_again(fields, at)
            return
        try:
            op = json.loads(fields.get("op", ""))
            if op.get("op") == "resync":  # a peer wrote back what Redis lost
                self._resync_due = True
                return
            name = op_instance(op)
            if name is not None and name in self._held:
                self._held[name].append((fields, at))
                return
            entry = {"origin": origin, "op": op, "at": _float(fields.get("at"))}
            if op.get("op") == "file" and name is not None:  # a peer's reload: its own file
                self._remember(entry)
                state = self.cluster.instances.get(name)
                if at is None and op.get("draining") and state is not None and not state.draining:
                    # Starting from the compacted state: the drain it keeps.
                    self.fleet.apply_op({"op": "drain", "name": name, "migrate": True})
                return
            if op.get("op") == "remove" and name is not None and name not in self.cluster.instances:
                # Gone here already (the compacted state keeps every removal, so a
                # process that starts reads them all): nothing to say.
                self._remember(entry)
                return
            state = self.cluster.instances.get(name) if name is not None else None
            if op.get("op") == "add" and state is not None and state.leaving:
                self._hold(str(name), fields, at)
                return
            self.fleet.apply_op(op)
            self._remember(entry)
            if at is not None and name is not None and self._made_here_after(name, at):
                self._rebase.add(name)
            # The kind and the name only: an added instance's api_key and headers
            # stay out of the logs.
            log.info("fleet change from %s applied: %s %s", origin, op["op"], name)
        except (ValueError, FleetError) as exc:
            # A peer's change that does not fit here (an instance this process
            # never had, one its file already adds): the rest of the fleet goes on.
            log.warning("fleet change from %s not applied here: %s", origin, exc)
        except Exception:  # noqa: BLE001 - another writer's record must not stop sharing
            log.exception("fleet change from %s not applied here: malformed", origin)

    def _hold(self, name: str, fields: dict[str, str], at: tuple[int, int] | None) -> None:
        """A peer's add of `name`, removed and added again, while the instance
        here is still being removed: the add, and the changes to `name` that
        follow it, are applied in order once the removal is done (applied at
        once, the add was refused, the name taken, and they changed the old
        instance). Its maker's removal waited for every process's streams; this
        one waits for its own: the peers' now stream on the new server."""
        self._held[name] = [(fields, at)]
        self.fleet.begin_replacement(name)

        async def release() -> None:
            try:
                await self.fleet.removed(name)
            finally:
                held = self._held.pop(name, [])
                self.fleet.end_replacement(name)
            for change in held:
                self._apply_change(*change)

        self._in_background(release(), f"add-{name}")

    def _made_here_after(self, name: str, at: tuple[int, int]) -> bool:
        """Whether a change to `name` made here comes after position `at` in the log."""
        return self._own_last.get(name, (0, 0)) > at or any(
            op_instance(op) == name for op in self._announced
        )

    def _own_again(self, fields: dict[str, str], at: tuple[int, int]) -> None:
        """A change made here, read back from the log at `at`: made again if a
        peer's change logged before it was applied after it."""
        try:
            op = json.loads(fields.get("op", ""))
        except ValueError:
            return
        name = op_instance(op)
        if name not in self._rebase:
            return
        self._apply_own(op)
        if not self._made_here_after(name, at):
            self._rebase.discard(name)

    def _apply_own(self, op: dict[str, Any]) -> None:
        """Make a change made here again. Drain, undrain and patch are made as
        they were; an add or a remove only where it has not taken effect."""
        kind, name = op.get("op"), op_instance(op)
        state = self.cluster.instances.get(name) if name is not None else None
        if (
            (kind == "add" and state is not None)
            or (kind == "remove" and (state is None or state.leaving))
            or kind == "file"
        ):
            return
        try:
            self.fleet.apply_op(op)
            log.info("fleet change made here applied again after a peer's: %s %s", kind, name)
        except FleetError as exc:
            log.warning("fleet change made here not applied again: %s", exc)

    def _apply_move(self, raw: str) -> None:
        try:
            request_id, destination, *rest = json.loads(raw)
            # An older peer sends [id, destination], then prewarm, reason, source.
            prewarm = rest[0] if rest else True
            reason = rest[1] if len(rest) > 1 and rest[1] == "rescue" else "rebalance"
            source = rest[2] if len(rest) > 2 and isinstance(rest[2], str) else None
        except (ValueError, TypeError):
            log.warning("ignoring a malformed move: %r", raw)
            return
        if type(request_id) is not int or not isinstance(destination, str):  # not a bool
            log.warning("ignoring a malformed move: %r", raw)
            return
        stream = self.migrator.streams.get(request_id)
        if (
            stream is None
            or not stream.movable
            or stream.instance == destination  # moved there by an earlier plan
            or source is not None
            and stream.instance != source  # it failed over since
            or destination not in self.cluster.instances
        ):
            return  # finished, moving already, gone on elsewhere, or the destination is gone
        log.info("%s (the lease holder's plan): request %s -> %s", reason, request_id, destination)
        self.migrator.submit(stream, destination, reason, prewarm is not False)

    async def _flush_announced(self) -> None:
        """Send the fleet changes made here, in order; one not sent stays queued
        (a fleet change must reach the peers)."""
        while self._announced:
            await self._record(self._announced[0])
            del self._announced[0]

    async def _record(self, op: dict[str, Any]) -> None:
        """Append one change to the fleet log (trimmed to `fleet_log_length`) and,
        in the same transaction, to its instance's compacted changes."""
        entry = {"origin": self.name, "op": op, "at": time.time()}
        name = op_instance(op)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    history: list[dict[str, Any]] = []
                    if name is not None:
                        await pipe.watch(self._fleet_state_key)
                        history = _history(await pipe.hget(self._fleet_state_key, name))
                    # A rollback seen only by this round would be hidden by this change.
                    newest = await self.redis.xrevrange(self._fleet_key, count=1)
                    self._check_rollback(_stream_id(newest[0][0]) if newest else (0, 0))
                    refused = _refused_add(op, history)
                    start = _story_start(history) or {}
                    if refused and (start.get("origin"), start.get("op")) == (self.name, op):
                        # This very add, sent before: Redis made it but its answer
                        # was lost (a timeout), so the op stayed queued.
                        await pipe.reset()
                        self._remember(start)
                        return
                    pipe.multi()
                    if name is not None and not refused:
                        state = json.dumps(compact(history, entry))
                        pipe.hset(self._fleet_state_key, name, state)
                    pipe.xadd(
                        self._fleet_key,
                        {"origin": self.name, "op": json.dumps(op), "at": repr(entry["at"])},
                        maxlen=self.settings.fleet_log_length,
                        approximate=False,
                    )
                    answers = await pipe.execute()
                    if refused:
                        log.warning(
                            "instance %s was added here and through %s at once: the fleet"
                            " keeps that one, logged first; this one is removed here",
                            name,
                            start.get("origin"),
                        )
                        self._adopt_logged(str(name))
                    elif name is not None:
                        self._own_last[name] = _stream_id(answers[-1])  # XADD's id
                        self._remember(entry)
                    return
                except WatchError:
                    continue  # another process changed the state meanwhile: again

    async def _resync(self) -> None:
        """Apply every instance's compacted changes, and read the log from now on."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(self._fleet_state_key)
        pipe.xrevrange(self._fleet_key, count=1)
        state, newest = await pipe.execute()
        for name in sorted(state, key=_text):
            self._apply_history(_text(name), _history(state[name]))
        # No state but a log: written by an older Ferry, so replay it from the start.
        self._fleet_seen = _text(newest[0][0]) if state and newest else "0"
        self._rebase.clear()  # the state says how each instance ends, in log order
        self._resync_due = False

    def _apply_history(self, name: str, history: list[dict[str, Any]]) -> None:
        """Apply an instance's compacted changes (from the hash, or the workers'
        file). Own changes were made here already, so their story is this
        process's story of the instance, whoever made each change."""
        entries = self._replayed(name, history)
        if name in self._held and entries and entries[0]["op"]["op"] == "remove":
            # The old instance is being removed already: the rest waits for that
            # in place of what was held (this is the newer account of it).
            self._held[name] = [(_fields(e), None) for e in entries[1:]]
            entries = []
        for entry in entries:
            self._apply_change(_fields(entry))
        self._fleet_state[name] = history
        self._snapshot_due = True

    def _replayed(self, name: str, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The changes of `history` to apply here. A remove and an add (the
        instance removed, then added again) where the instance here is the one
        added already (a resync) are a patch of what the add set: removed, it
        would be lost to its streams and dropped in processes that made the
        add. Elsewhere (a process whose file names the old server) they go as
        they are."""
        if len(history) < 2 or [e["op"]["op"] for e in history[:2]] != ["remove", "add"]:
            return history
        add, rest = history[1], history[2:]
        changes = self.fleet.added_here(name, add["op"].get("instance"))
        if changes is None:
            return history
        # Not what a later patch sets: one made here is not applied again (it
        # was, here), so the add's value would undo it.
        later = {
            key
            for e in rest
            if e["op"]["op"] == "patch" and isinstance(e["op"].get("changes"), dict)
            for key in e["op"]["changes"]
        }
        changes = {k: v for k, v in changes.items() if k not in later}
        patch = {**add, "op": {"op": "patch", "name": name, "changes": changes}}
        return [patch, *rest]

    def _remember(self, entry: dict[str, Any]) -> None:
        """Keep an applied change in this process's compacted state."""
        name = op_instance(entry["op"])
        if name is not None:
            # In the order they were made (by their makers' clocks): a peer's change
            # read after one made here may have been made before it.
            self._fleet_state[name] = _merged(self._fleet_state.get(name, []), [entry])
            self._snapshot_due = True

    def _adopt_logged(self, name: str) -> None:
        """This process's add of `name` was refused in log order (a peer's add,
        logged first, stands everywhere else): remove its own here alone (its
        streams move off), then take the fleet's account of the instance."""
        state = self.cluster.instances.get(name)
        if state is not None and not state.leaving:
            self.fleet.remove(name, migrate=True)
        self._in_background(self._adopt(name), f"adopt-{name}")

    def _in_background(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run `work` as a task `stop` cancels."""
        task = asyncio.create_task(work, name=name)
        self._adopting.add(task)
        task.add_done_callback(self._adopting.discard)

    async def _adopt(self, name: str) -> None:
        if not await self.fleet.removed(name):
            return  # its removal was called off meanwhile
        try:
            history = _history(await self.redis.hget(self._fleet_state_key, name))
        except (RedisError, OSError) as exc:
            log.warning("instance %s not taken from the fleet (on the next resync): %s", name, exc)
            self._resync_due = True
            return
        self._apply_history(name, history)

    def _apply_snapshot(self) -> None:
        """Begin from the fleet state the sibling workers held last (a worker
        started again while Redis is down): the drains, removals and additions
        made since the file was read, which it would otherwise not know until
        Redis is back, sending traffic where they send none. Read once, at the
        start, before this process serves."""
        if self.snapshot_path is None:
            return
        try:
            with open(self.snapshot_path, encoding="utf-8") as f:
                state = json.load(f)
        except FileNotFoundError:
            return  # nothing changed since the workers started
        except (OSError, ValueError) as exc:
            log.warning("cannot read the workers' fleet state %s: %s", self.snapshot_path, exc)
            return
        if not isinstance(state, dict):
            return
        for name in sorted(state):
            self._apply_history(name, _history(json.dumps(state[name])))
        log.info("began from the fleet state the other workers held (%d instances)", len(state))

    def _check_epoch(self, epoch: str | None) -> bool:
        """Redis's epoch, read this round: one that changed says it lost its data,
        the fleet log too: what it holds now was written since, read from its
        start. Whether it did."""
        lost = self._epoch is not None and epoch != self._epoch
        if lost:
            log.warning("Redis lost the shared state (restarted or flushed)")
            self._fleet_seen = "0"
            self._own_last.clear()
            self._restore_due = bool(self._fleet_state)
        self._epoch = epoch
        return lost

    def _check_rollback(self, newest: tuple[int, int]) -> None:
        """The fleet log's newest change, read this round (or before a change is
        written). Older than one this process read or wrote, it says Redis went
        back to a snapshot (same epoch) that predates the last changes: this
        process writes back what it holds, merged by time with what is there."""
        known = max([_stream_id(self._fleet_seen), *self._own_last.values()])
        if newest < known and not self._restore_due:
            log.warning("Redis went back to an older snapshot: writing back the fleet changes")
            self._restore_due = bool(self._fleet_state)
            self._fleet_seen = f"{newest[0]}-{newest[1]}"
            self._own_last = {n: min(at, newest) for n, at in self._own_last.items()}

    async def _restore(self) -> None:
        """Write back this process's fleet state, merged in time order with what
        the hash holds by now (changes made since the loss, and other processes'
        write-backs, which may know a change this one missed or miss one it
        knows), and have every process apply it again."""
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(self._fleet_state_key)
                    now = {
                        _text(k): v for k, v in (await pipe.hgetall(self._fleet_state_key)).items()
                    }
                    pipe.multi()
                    for name, history in self._fleet_state.items():
                        merged = _merged(history, _history(now.get(name)))
                        pipe.hset(self._fleet_state_key, name, json.dumps(merged))
                    op = json.dumps({"op": "resync"})
                    pipe.xadd(
                        self._fleet_key,
                        {"origin": self.name, "op": op},
                        maxlen=self.settings.fleet_log_length,
                        approximate=False,
                    )
                    await pipe.execute()
                    break
                except WatchError:
                    continue
        self._restore_due = False

    def _went_wrong(self, exc: Exception) -> None:
        if not self._failing:
            log.error("Redis unreachable, serving with this process's view alone: %s", exc)
            self._failing = True
        last = self._last_round
        if last is not None and self.clock() - last > self.settings.ttl_s:
            # Their records would have expired by now: they may be dead. (Their
            # announced changes too: a dead peer's may still be in flight.)
            self.peers = PeerLoads()
            self.cluster.set_peer_load({})

    # -- what a scrape of /metrics shows ---------------------------------------------
    async def merged_metrics(self, own: bytes) -> bytes:
        """This process's exposition with those of the live processes serving the
        same host and port merged in; its own alone if Redis cannot be read."""
        peers = [m for m in self._members if m != self.name]
        if not peers:
            return own
        # Unread while the rounds fail: a hung Redis held each scrape for the
        # client's timeout. The peers' counters then are those last read: without
        # them the sum would drop, and Prometheus reads a drop as a counter reset.
        if not self._failing:
            try:
                # A peer in another group has no key in this one: it reads as None.
                texts = await self.redis.mget([self._metrics_key(m) for m in peers])
                self._peer_metrics = [_text(t) for t in texts if t is not None]
            except (RedisError, OSError) as exc:
                log.debug("peers' metrics unreadable, serving their last: %s", exc)
        found = self._peer_metrics
        if not found:
            return own
        # Parsing several expositions takes milliseconds: off the event loop.
        return await asyncio.to_thread(merge, own.decode(), found)

    def _metrics_key(self, process: str) -> str:
        return f"{self._metrics_prefix}{self.metrics_group}:{process}"

    # -- what the admin API shows ---------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "process": self.name,
            "holds_lease": self.holds_lease(),
            "lease_holder": None if self._failing else self.lease_holder,  # unknown then
            "redis_ok": not self._failing,
            # Peers listing other instances (names or URLs) than this process.
            "other_instances": sorted(self._differ_since),
            "peers": {
                name: {
                    n: {
                        "virtual_blocks": load.blocks,
                        "inflight": load.inflight,
                        "high_priority": load.high,
                        "queued_tokens": load.queued_tokens,
                        "waiting": load.waiting,
                    }
                    for n, load in self.peers.of(name).items()
                    if not load.empty
                }
                for name in sorted(self.peers.records)
            },
        }


def _fields(entry: dict[str, Any]) -> dict[str, str]:
    """A compacted change as the fleet log's fields."""
    return {"origin": str(entry.get("origin", "")), "op": json.dumps(entry["op"])}


def _text(value: Any) -> str:
    # Not UTF-8 is not Ferry's: it reads as text that names nothing of Ferry's.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _stream_id(value: Any) -> tuple[int, int]:
    """A stream id ("ms-seq", or "0") in the order Redis keeps them."""
    ms, _, seq = _text(value).partition("-")
    return int(ms), int(seq or 0)


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _merged(*histories: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One instance's compacted changes from several accounts of them, each
    change once, applied in the order they were made (by the wall clock of the
    process that made it; an older Ferry's, with no time, first)."""
    changes: dict[str, dict[str, Any]] = {}
    for entry in (part for history in histories for e in history for part in _unmerged(e)):
        changes.setdefault(json.dumps(entry, sort_keys=True), entry)
    out: list[dict[str, Any]] = []
    for entry in sorted(changes.values(), key=lambda e: _float(e.get("at"))):
        out = compact(out, entry)
    return out


def _unmerged(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A compacted patch as the changes it was made of, each at its own time
    (`fleet.compact` keeps them); any other entry as it is."""
    op = entry["op"]
    if op["op"] != "patch" or not isinstance(op.get("changes"), dict):
        return [entry]
    times = patch_times(entry)
    return [
        {"origin": entry.get("origin"), "op": {**op, "changes": {key: value}}, "at": times.get(key)}
        for key, value in op["changes"].items()
    ]


def _refused_add(op: dict[str, Any], history: list[dict[str, Any]]) -> bool:
    """Whether `op` adds an instance the log has added already, and not removed
    since: applied in log order it is refused (the name exists), so it leaves
    the compacted state as it is (two processes that added one name at once)."""
    start = _story_start(history)
    return op.get("op") == "add" and start is not None and start["op"]["op"] == "add"


def _story_start(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last add, remove or reload of an instance's compacted changes (an
    add may follow a remove, `fleet.compact`)."""
    return next((e for e in reversed(history) if e["op"]["op"] in ("add", "remove", "file")), None)


def _history(raw: Any) -> list[dict[str, Any]]:
    """An instance's compacted changes as stored; a malformed value counts as none."""
    try:
        entries = json.loads(_text(raw)) if raw is not None else []
    except (ValueError, RecursionError):
        return []
    ok = isinstance(entries, list) and all(
        isinstance(e, dict) and isinstance(e.get("op"), dict) and isinstance(e["op"].get("op"), str)
        for e in entries
    )
    return entries if ok else []


async def _write_snapshot(path: str, text: str) -> None:
    """Replace the workers' fleet state file whole (a reader never sees half of
    it), off the event loop; a failure is logged, not raised: it only helps."""

    def write() -> None:
        partial = f"{path}.{os.getpid()}"
        with open(partial, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(partial, path)

    try:
        await blocking_io.call(write)
    except OSError as exc:
        log.warning("cannot write the workers' fleet state %s: %s", path, exc)
