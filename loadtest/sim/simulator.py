"""The event loop: arrivals, engine steps, scrapes, rescheduling, KV copies.

Events sit in a heap ordered by (time, kind, sequence). At one timestamp a step
end goes first (it frees blocks), then a finished KV copy, then arrivals, then
the scrape, the rescheduler and the scaling rule, so a decision sees the
freshest state (an instance whose startup ends at that moment serves from the
next one); the sequence number, owned by the simulator, keeps the order
deterministic.

Dispatch and rescheduling call the proxy's policy core on views built exactly
as the proxy builds them (ledger totals, plus scraped fields refreshed every
`scrape_interval_s`). Rescheduling runs `plan_migrations` with its lite-mode cost
model on (`count_recompute`) when moves recompute; a lite move enqueues the
request on the destination with prompt + generated tokens, which it prefills
again, delaying its own queue and batch as the model charges.

Autoscaling (`SimSettings.scaling`) plays the external autoscaler reading
`ferry_desired_instances`: every `scaling_interval_s` the policy core's
`scaling_signal` reads the view, and the fleet is set to the desired count as a
Kubernetes ReplicaSet would, scaling in only as far as the highest desired
count of the last `scale_in_window_s` allows (the HPA's scale-down stabilization
window, 300 s by default there: an instantaneous freeness is noisy, and a
removal undone a minute later costs a startup). A new instance is in the view
(unhealthy, not dispatchable) from when it is asked for and serves `startup_s`
later. Scale-in
removes starting instances first, then drains the serving ones with the fewest
requests: no new dispatch, every request moved off by migration when migration
is on (as `DELETE /admin/instances/{name}?migrate=true` does), retired once
empty. An instance costs from when it is asked for until it is retired (or the
run ends): `instance_seconds`.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.sim.instance import Instance, SimRequest
from loadtest.sim.prefix_cache import index_key
from loadtest.sim.profile import Profile
from loadtest.trace import TraceRequest
from proxy.policy import (
    ClusterView,
    DispatchRequest,
    InstanceView,
    NoCandidate,
    Priority,
    UsageSettings,
    dispatch,
    make_policy,
)
from proxy.policy.migration import (
    MigrationSettings,
    RequestLoad,
    plan_drain,
    plan_migrations,
    sources,
)
from proxy.policy.policies import CROWD_FACTOR, CROWD_GRACE
from proxy.policy.priority import make_room_victims
from proxy.policy.scaling import ScalingSettings, scaling_signal
from proxy.policy.virtual_usage import instance_view, request_blocks
from proxy.prefix_index import PrefixIndex

MODES = ("off", "lite", "full")
MODEL = "m"


class Kind(enum.IntEnum):
    STEP_END = 0
    COPY_DONE = 1
    ARRIVAL = 2
    WAKE = 3  # a migrated request's downtime ended on an idle instance
    SCRAPE = 4
    RESCHEDULE = 5
    SCALE = 6  # autoscaling: the scaling rule reads the view
    READY = 7  # autoscaling: a started instance serves from now on


@dataclass(frozen=True, slots=True)
class SimSettings:
    instances: int
    policy: str = "llumnix"
    migration: str = "off"  # off | lite | full
    priorities: bool = True  # False: every request counts as normal
    high_priority_headroom_blocks: float | None = None  # None: the proxy's default share
    scrape_interval_s: float = 0.05
    reschedule_interval_s: float = 0.05
    migration_settings: MigrationSettings = MigrationSettings()
    seed: int = 0
    # Autoscaling (None: a fixed fleet of `instances`, the fleet it starts with otherwise).
    scaling: ScalingSettings | None = None
    scaling_interval_s: float = 10.0  # how often the rule is applied, simulated seconds
    startup_s: float = 40.0  # from asking for an instance to its first request
    scale_in_window_s: float = 60.0  # scale in to the highest desired count seen this long
    # Prefix locality (loadtest/sim/prefix_cache.py): the engines cache prefixes;
    # llumnix places by prefill ahead (cache_aware always reads the index).
    prefix_caching: bool = False
    prefill_aware: bool = True  # llumnix: as the proxy's scheduler.prefill_aware
    prefix_credit: bool = False
    affinity_margin_blocks: float = 32.0
    prefix_safe_freeness: float = 1.0
    prefix_crowd_factor: float = CROWD_FACTOR
    prefix_crowd_grace: float = CROWD_GRACE
    # The make-room rule: the policy core's (a benchmark passes another to compare).
    make_room: Callable[..., list[int]] = make_room_victims


class Simulator:
    def __init__(
        self, trace: Sequence[TraceRequest], profile: Profile, settings: SimSettings
    ) -> None:
        if settings.migration not in MODES:
            raise ValueError(f"migration must be one of {', '.join(MODES)}")
        self.profile, self.settings = profile, settings
        self.instances = [self._new_instance(f"i{n}") for n in range(settings.instances)]
        self.by_name = {i.name: i for i in self.instances}
        options: dict[str, float | bool] = {}
        credit = settings.policy == "llumnix" and settings.prefix_credit
        if credit:
            options = {
                "prefix_credit": True,
                "affinity_margin": settings.affinity_margin_blocks,
                "safe_freeness": settings.prefix_safe_freeness,
                "crowd_factor": settings.prefix_crowd_factor,
                "crowd_grace": settings.prefix_crowd_grace,
            }
        if settings.policy == "llumnix":
            options["prefill_aware"] = settings.prefill_aware
        self.policy = make_policy(settings.policy, **options)
        # Ferry's own prefix index, recorded at dispatch as the proxy records it.
        self.prefixes = PrefixIndex(
            block_size=profile.block_size,
            enabled=settings.policy == "cache_aware" or credit,
        )
        self.usage = UsageSettings(settings.high_priority_headroom_blocks)
        self.rng = random.Random(settings.seed)
        self.requests = []
        for t in trace:
            klass = Priority.parse(t.priority)
            seen = klass if settings.priorities else Priority.NORMAL
            self.requests.append(
                SimRequest(
                    t.id,
                    t.arrival_s,
                    t.prompt_tokens,
                    t.output_tokens,
                    seen,
                    klass,
                    t.prefix_group,
                    t.prefix_tokens,
                    t.session,
                )
            )
        self.by_id = {r.id: r for r in self.requests}
        self._copying: set[int] = set()  # requests whose full-mode copy is in flight
        # Lite moves recompute on the destination; full moves carry their KV.
        ms = settings.migration_settings
        self.migration_settings = dataclasses.replace(
            ms, count_recompute=ms.count_recompute and settings.migration == "lite"
        )
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.dispatches = 0
        self.migrations: dict[str, int] = {"started": 0, "done": 0, "aborted": 0, "for_priority": 0}
        self.scraped = {i.name: (0.0, 0, 0) for i in self.instances}  # kv_usage, running, waiting
        self.done = 0
        self.now = 0.0
        # Autoscaling: when each instance was asked for and retired; the fleet over time.
        self.born = {i.name: 0.0 for i in self.instances}
        self.retired: dict[str, float] = {}
        self.fleet_log: list[tuple[float, int, int]] = []  # (time, not draining, alive)
        self.scaling_log: list[tuple[float, int, float | None]] = []  # (time, desired, F)
        self._log_fleet()

    def push(self, time: float, kind: Kind, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time, kind, self.seq, payload))

    def run(self, progress: Callable[[int, int], None] | None = None) -> list[SimRequest]:
        for r in self.requests:
            self.push(r.arrival, Kind.ARRIVAL, r)
        self.push(0.0, Kind.SCRAPE, None)
        if self.settings.migration != "off":
            self.push(0.0, Kind.RESCHEDULE, None)
        if self.settings.scaling is not None:
            self.push(self.settings.scaling_interval_s, Kind.SCALE, None)
        total = len(self.requests)
        handlers: dict[int, Callable[[Any], None]] = {
            Kind.STEP_END: self._step_end,
            Kind.COPY_DONE: self._copy_done,
            Kind.ARRIVAL: self._arrival,
            Kind.WAKE: self._kick,
            Kind.SCRAPE: self._scrape,
            Kind.RESCHEDULE: self._reschedule,
            Kind.SCALE: self._scale,
            Kind.READY: self._ready,
        }
        reported = 0
        while self.heap and self.done < total:
            self.now, kind, _, payload = heapq.heappop(self.heap)
            handlers[kind](payload)
            if progress and self.done >= reported + 1000:
                reported = self.done - self.done % 1000
                progress(reported, total)
        return self.requests

    # views ------------------------------------------------------------------
    def view(self) -> ClusterView:
        return ClusterView(tuple(self._instance_view(i) for i in self.instances), self.dispatches)

    def _instance_view(self, inst: Instance) -> InstanceView:
        kv, running, waiting = self.scraped[inst.name]
        return instance_view(
            inst.name,
            capacity_blocks=inst.capacity,
            real_blocks=sum(inst.reserved.values()) + inst.demand,
            high_priority_requests=inst.high,
            batch=inst.count,
            inflight=inst.count,
            settings=self.usage,
            kv_usage=kv,
            engine_running=running,
            engine_waiting=waiting,
            # As the proxy counts them: the engine's queue beyond the requests
            # here with no token yet is most likely preempted.
            engine_preempted=max(0, waiting - inst.awaiting),
            queued_tokens=inst.queued_tokens,
            block_size=self.profile.block_size,
            healthy=inst.healthy,
            draining=inst.draining,
            models=frozenset({MODEL}),
        )

    # events -----------------------------------------------------------------
    def _new_instance(self, name: str) -> Instance:
        return Instance(name, self.profile, self.settings.prefix_caching)

    def _arrival(self, r: SimRequest) -> None:
        request = DispatchRequest(MODEL, r.prompt, r.priority)
        key = None
        if self.prefixes.enabled:
            key = index_key(r, r.prompt, self.profile.block_size)
            request = dataclasses.replace(
                request,
                cached_tokens=self.prefixes.cached_tokens(key),
                affinity=self.prefixes.affinity(key),
            )
        view = self.view()
        chosen = dispatch(self.policy, request, view, self.rng)
        self.dispatches += 1
        if key is not None:
            self.prefixes.record(chosen.name, key, chosen.capacity_blocks)
        inst = self.by_name[chosen.name]
        if r.priority is Priority.HIGH and self.settings.migration != "off":
            self._make_room(view, chosen, request_blocks(r.prompt, self.profile.block_size))
        inst.enqueue(r, request.cached_tokens.get(chosen.name, 0))
        self._kick(inst)

    def _make_room(self, view: ClusterView, chosen: InstanceView, blocks: int) -> None:
        """As the proxy's migrator: the policy core picks the victims on `chosen`,
        and each moves to the freest other instance."""
        inst = self.by_name[chosen.name]
        candidates = [_load(r, self.now) for r in self._movable(inst)]
        for victim in self.settings.make_room(chosen, blocks, candidates, view.instances):
            victim_load = self.by_id[victim]
            others = DispatchRequest(
                MODEL, victim_load.tokens, victim_load.priority, frozenset({chosen.name})
            )
            try:
                dest = dispatch(self.policy, others, view, self.rng)
            except NoCandidate:
                return
            self.migrations["for_priority"] += 1
            self._start_migration(victim, chosen.name, dest.name)

    def _kick(self, inst: Instance) -> None:
        if not inst.busy:
            dt = inst.start_step(self.now)
            if dt is not None:
                self.push(self.now + dt, Kind.STEP_END, inst)

    def _step_end(self, inst: Instance) -> None:
        finished, cut = inst.finish_step(self.now)
        self.done += len(finished)
        for r in finished:  # as the proxy does when a call ends
            self.prefixes.record_generated(inst.name, r.generated, self.profile.block_size)
        for r in cut:
            self._cut_over(inst, r)
        self._kick(inst)
        self._retire_if_drained(inst)

    def _scrape(self, _: None) -> None:
        for inst in self.instances:
            self.scraped[inst.name] = (
                inst.used / inst.capacity,
                len(inst.running),
                len(inst.waiting),
            )
        self.push(self.now + self.settings.scrape_interval_s, Kind.SCRAPE, None)

    def _reschedule(self, _: None) -> None:
        self.push(self.now + self.settings.reschedule_interval_s, Kind.RESCHEDULE, None)
        self._drain_round()
        view = self.view()
        ms = self.migration_settings
        names = sources(view, ms)
        if not names:
            return
        candidates = {
            n: [_load(r, self.now) for r in self._movable(self.by_name[n])] for n in names
        }
        block_size = {n: self.profile.block_size for n in names}
        for move in plan_migrations(view, candidates, block_size, ms):
            self._start_migration(move.request_id, move.source, move.destination)

    def _movable(self, inst: Instance) -> list[SimRequest]:
        """Its requests not already on their way elsewhere (a cut-over, or a
        full-mode copy in flight)."""
        return [
            r
            for r in (*inst.waiting, *inst.running)
            if r.cut_to is None and r.id not in self._copying
        ]

    # migration ----------------------------------------------------------------
    def _start_migration(self, request_id: int, source: str, destination: str) -> None:
        r = self.by_id[request_id]
        src, dst = self.by_name[source], self.by_name[destination]
        if r.instance is not src or r.finish is not None or src is dst:
            return
        if r.cut_to is not None or r.id in self._copying:  # on its way already
            return
        self.migrations["started"] += 1
        if not r.running:  # queued: nothing computed yet, the move is free
            src.detach(r)
            dst.enqueue(r)
            r.migrations += 1
            self.migrations["done"] += 1
            self._kick(dst)
            self._retire_if_drained(src)
            return
        if self.settings.migration == "lite":
            r.cut_to = ("lite", dst, 0)
            if not src.busy:
                self._cut_over(src, r)
            return
        blocks = src.blocks_for(r.tokens + 1)
        if not dst.reserve(r.id, blocks):
            self.migrations["aborted"] += 1
            return
        self._copying.add(r.id)
        # Pre-copy in stages while the source keeps decoding; done when the bulk is across.
        self.push(self.now + self.profile.copy_time(r.tokens), Kind.COPY_DONE, (r, dst, r.tokens))

    def _copy_done(self, payload: tuple[SimRequest, Instance, int]) -> None:
        r, dst, copied = payload
        self._copying.discard(r.id)
        if r.finish is not None or r.instance is None:
            dst.release(r.id)
            self.migrations["aborted"] += 1
            return
        r.cut_to = ("full", dst, copied)
        if not r.instance.busy:
            self._cut_over(r.instance, r)

    def _cut_over(self, src: Instance, r: SimRequest) -> None:
        """Between two of the source's steps: stop r there and continue it on the destination."""
        assert r.cut_to is not None
        mode, dst, copied = r.cut_to
        r.cut_to = None
        src.detach(r)
        r.migrations += 1
        self.migrations["done"] += 1
        self._retire_if_drained(src)
        if mode == "full":
            dst.release(r.id)
            # Stop-and-copy of the tokens generated during the pre-copy, then resume.
            downtime = self.profile.copy_time(max(1, r.tokens - copied))
            if dst.attach_running(r, self.now + downtime):
                self._kick(dst)
                self.push(self.now + downtime, Kind.WAKE, dst)
                return
        # lite (or full without room left): the destination recomputes prompt + generated.
        dst.enqueue(r)
        self._kick(dst)

    # autoscaling ----------------------------------------------------------------
    def _scale(self, _: None) -> None:
        """The autoscaler: set the fleet (instances not draining) to the desired count."""
        assert self.settings.scaling is not None
        self.push(self.now + self.settings.scaling_interval_s, Kind.SCALE, None)
        signal = scaling_signal(self.view(), self.settings.scaling)
        self.scaling_log.append((self.now, signal.desired, signal.freeness))
        fleet = [i for i in self.instances if not i.draining]
        for _n in range(signal.desired - len(fleet)):
            self._add_instance()
        since = self.now - self.settings.scale_in_window_s
        target = max(d for t, d, _f in self.scaling_log if t >= since)
        excess = len(fleet) - target
        if excess <= 0:
            return
        starting = [i for i in fleet if not i.healthy]
        for inst in starting[::-1][:excess]:  # newest first, as a ReplicaSet removes unready pods
            self._retire(inst)
        excess -= min(excess, len(starting))
        serving = sorted((i for i in fleet if i.healthy), key=lambda i: i.count)
        for inst in serving[:excess]:
            self._drain(inst)

    def _add_instance(self) -> None:
        inst = self._new_instance(f"i{len(self.born)}")
        inst.healthy = False
        self.instances.append(inst)
        self.by_name[inst.name] = inst
        self.scraped[inst.name] = (0.0, 0, 0)
        self.born[inst.name] = self.now
        self.push(self.now + self.settings.startup_s, Kind.READY, inst)
        self._log_fleet()

    def _ready(self, inst: Instance) -> None:
        if inst.name not in self.retired:  # not cancelled while it started
            inst.healthy = True

    def _drain(self, inst: Instance) -> None:
        """Scale-in: no new dispatch; with migration on, requests move off as other
        instances have room for them (the proxy's drain: `plan_drain`, now and every
        rescheduling round), the rest finish here. Retired once empty."""
        inst.draining = True
        self._log_fleet()
        if self.settings.migration != "off":
            self._drain_round()
        self._retire_if_drained(inst)

    def _drain_round(self) -> None:
        draining = [i for i in self.instances if i.draining]
        # As the proxy's: a round waits for the last one's moves to land.
        if any(r.cut_to is not None for i in draining for r in i.running):
            return
        candidates = {i.name: [_load(r, self.now) for r in self._movable(i)] for i in draining}
        if not any(candidates.values()):
            return
        reserve = self.migration_settings.dest_reserve_blocks
        for move in plan_drain(self.view(), candidates, reserve):
            self._start_migration(move.request_id, move.source, move.destination)

    def _retire_if_drained(self, inst: Instance) -> None:
        if inst.draining and inst.empty and inst.name not in self.retired:
            self._retire(inst)

    def _retire(self, inst: Instance) -> None:
        self.instances.remove(inst)
        self.retired[inst.name] = self.now
        self._log_fleet()

    def _log_fleet(self) -> None:
        fleet = sum(1 for i in self.instances if not i.draining)
        self.fleet_log.append((self.now, fleet, len(self.instances)))

    def instance_seconds(self) -> float:
        """What the run paid for: each instance from when it was asked for until it
        was retired, or until now (the run's end)."""
        return sum(self.retired.get(name, self.now) - born for name, born in self.born.items())


def _load(r: SimRequest, now: float) -> RequestLoad:
    # "Running" as the proxy's ledger sees it: it has streamed tokens (a request the
    # engine preempted is still running to the proxy, and a move recomputes it).
    silent = 0.0 if r.last_token is None else now - r.last_token
    return RequestLoad(r.id, r.tokens, r.priority, running=r.generated > 0, silent_s=silent)
