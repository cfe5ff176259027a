"""The rescheduler: every tick, the policy core plans migrations and this executes them.

Contract: `start()` launches one task and returns; `stop()` cancels and awaits
it. Each tick builds the cluster view over migration-enabled instances, asks
`plan_migrations` (pure) what to move, and submits the moves to the migrator,
no more than it has free slots for. The policy states its reason with every
move; it is logged.
"""

from __future__ import annotations

import asyncio
import logging

from proxy.cluster import Cluster
from proxy.metrics import FerryMetrics
from proxy.migrator import Migrator
from proxy.policy import ClusterView
from proxy.policy.migration import MigrationSettings, plan_migrations, sources

log = logging.getLogger("ferry.rescheduler")


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
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Tick every `interval_s`; an interval of 0 means no rebalancing."""
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name="rescheduler")

    def retune(self, settings: MigrationSettings, interval_s: float) -> None:
        """New settings from the next tick on (a reload); 0 stops rebalancing."""
        self.settings, self.interval_s = settings, interval_s
        if interval_s <= 0 and self._task is not None:
            self._task.cancel()  # between ticks: tick() never awaits
            self._task = None
        self.start()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.tick()

    def tick(self) -> int:
        """Plan and submit moves; returns how many were submitted."""
        if self.metrics is not None:
            self.metrics.rescheduler_ticks.inc()
        room = self.migrator.free_slots
        if room <= 0:
            return 0
        usable = self.migrator.placement.migration_instances()
        full = self.cluster.view()
        view = ClusterView(tuple(v for v in full.instances if v.name in usable), full.dispatch_seq)
        names = sources(view, self.settings)
        if not names:
            return 0
        candidates = {n: self.migrator.candidates(n) for n in names}
        block_size = {n: self.cluster.block_size(n) for n in names}
        plan = plan_migrations(view, candidates, block_size, self.settings)[:room]
        running = {r.id for loads in candidates.values() for r in loads if r.running}
        for move in plan:
            if self.metrics is not None:
                kind = "running" if move.request_id in running else "queued"
                self.metrics.moves_planned.labels(kind).inc()
            log.info(
                "rebalance: request %s %s -> %s: %s",
                move.request_id,
                move.source,
                move.destination,
                move.reason,
            )
            self.migrator.submit(
                self.migrator.streams[move.request_id], move.destination, "rebalance"
            )
        return len(plan)
