"""The rescheduler: every tick, the policy core plans migrations and this executes them.

Contract: `start()` launches one task and returns; `stop()` cancels and awaits
it. Each tick builds the cluster view over migration-enabled instances, asks
`plan_migrations` (pure) what to move, and submits the moves to the migrator,
no more than it has free slots for. The policy states its reason with every
move; it is logged.

With a shared view (proxy/sharing.py) the rescheduler is given a `Coordinator`:
only the process holding the rescheduler lease plans, over the global view and
the movable streams of every process; a move of another process's stream is
sent to that process, which submits it to its own migrator. Failover is not the
rescheduler's: a broken stream resumes in the process that holds it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from proxy.cluster import Cluster
from proxy.faults import Faults
from proxy.metrics import FerryMetrics
from proxy.migrator import Migrator
from proxy.policy import ClusterView
from proxy.policy.migration import MigrationSettings, RequestLoad, plan_migrations, sources

log = logging.getLogger("ferry.rescheduler")


class Coordinator(Protocol):
    """The processes sharing the view (proxy/sharing.py), as the rescheduler uses them."""

    def holds_lease(self) -> bool:
        """Whether this process plans the moves now."""

    def peer_candidates(self) -> Mapping[str, Mapping[str, Sequence[RequestLoad]]]:
        """Each peer's movable streams by instance (ids are the peer's own)."""

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
        """Ask `owner` to move its stream `request_id`, planned off `source`, to
        `destination` (warming the destination first, or not, for `reason`: see
        `Migrator.submit`)."""


class Rescheduler:
    def __init__(
        self,
        cluster: Cluster,
        migrator: Migrator,
        settings: MigrationSettings,
        *,
        interval_s: float,
        metrics: FerryMetrics | None = None,
    ) -> None:
        self.cluster = cluster
        self.metrics = metrics
        self.migrator = migrator
        self.settings = settings
        self.interval_s = interval_s
        self.coordinator: Coordinator | None = None  # set when the view is shared
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Tick every `interval_s`; an interval of 0 means no rebalancing."""
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name="rescheduler")

    def retune(self, settings: MigrationSettings, interval_s: float) -> None:
        """New settings from the next tick on (a reload); 0 stops rebalancing.
        A new interval starts at once (a wait of the old one, 600 s, held a
        shorter one off until it was over)."""
        changed = interval_s != self.interval_s
        self.settings, self.interval_s = settings, interval_s
        if (changed or interval_s <= 0) and self._task is not None:
            self._task.cancel()  # between ticks: tick() never awaits
            self._task = None
        self.start()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        faults = Faults(log, "a rescheduler tick")
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - rebalancing must outlive one tick
                faults.failed(exc)
            else:
                faults.ok()

    def local_candidates(self) -> dict[str, list[RequestLoad]]:
        """This process's movable streams on the instances that would shed load now
        (what it publishes for the lease holder); none while rebalancing is off."""
        if self.interval_s <= 0:
            return {}
        names = sources(self._view(), self.settings)
        return {n: loads for n in names if (loads := self.migrator.candidates(n))}

    def _settings_now(self, view: ClusterView) -> MigrationSettings:
        """The settings, with the recompute a move costs weighed wherever some
        instance that takes part in moves now moves by recompute: a `full` one
        whose shim is not there moves in lite mode (an all-`full` fleet planned
        as if the KV moved along, and its lite moves stalled every stream where
        they landed). One down or drained takes no part."""
        settings = self.settings
        instances = self.cluster.instances  # (the view's: those taking part in moves)
        lite = any(instances[v.name].migration_mode == "lite" for v in view.instances)
        if lite and not settings.count_recompute:
            return dataclasses.replace(settings, count_recompute=True)
        return settings

    def _view(self) -> ClusterView:
        """The view over the migration-enabled instances."""
        placement = self.migrator.placement
        return placement.view_of(placement.migration_instances())

    def tick(self) -> int:
        """Plan and submit moves; returns how many were planned."""
        if self.coordinator is not None and not self.coordinator.holds_lease():
            return 0
        if self.metrics is not None:
            self.metrics.rescheduler_ticks.inc()
        view = self._view()
        names = sources(view, self.settings)
        if not names:
            return 0
        candidates, owners = self._pool(names)
        block_size = {n: self.cluster.block_size(n) for n in names}
        planned = plan_migrations(view, candidates, block_size, self._settings_now(view))
        # Rescues take no slot (see Migrator.submit); the other moves fill what is free.
        room = self.migrator.free_slots
        plan = [m for m in planned if m.preempted]
        plan += [m for m in planned if not m.preempted][:room]
        running = {r.id for loads in candidates.values() for r in loads if r.running}
        for move in plan:
            if self.metrics is not None:
                kind = "running" if move.request_id in running else "queued"
                self.metrics.moves_planned.labels(kind).inc()
            owner, request_id = owners[move.request_id]
            log.info(
                "rebalance: request %s%s %s -> %s: %s",
                request_id,
                "" if owner is None else f" of {owner}",
                move.source,
                move.destination,
                move.reason,
            )
            reason = "rescue" if move.preempted else "rebalance"
            if owner is None:
                stream = self.migrator.streams[request_id]
                self.migrator.submit(stream, move.destination, reason, move.prewarm)
            else:
                assert self.coordinator is not None
                self.coordinator.send_move(
                    owner, request_id, move.destination, move.prewarm, reason, source=move.source
                )
        return len(plan)

    def _pool(
        self, names: list[str]
    ) -> tuple[dict[str, list[RequestLoad]], dict[int, tuple[str | None, int]]]:
        """The candidates on `names` of this process and its peers, numbered anew
        (ids are unique only within a process), and each number's (owner, id);
        owner None is this process."""
        pooled: dict[str, list[RequestLoad]] = {n: [] for n in names}
        owners: dict[int, tuple[str | None, int]] = {}
        groups: list[tuple[str | None, Mapping[str, Sequence[RequestLoad]]]] = [
            (None, {n: self.migrator.candidates(n) for n in names})
        ]
        if self.coordinator is not None:
            groups += list(self.coordinator.peer_candidates().items())
        for owner, by_instance in groups:
            for name in names:
                for load in by_instance.get(name, ()):
                    number = len(owners) + 1
                    owners[number] = (owner, load.id)
                    pooled[name].append(dataclasses.replace(load, id=number))
        return pooled, owners
