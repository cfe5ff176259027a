"""The rescheduler: every tick, the policy core plans migrations and this executes them.

Contract: `start()` launches one task and returns; `stop()` cancels and awaits
it. Each tick builds the cluster view over migration-enabled instances, asks
`plan_migrations` (pure) what to move, and starts at most `max_concurrent`
moves at a time, each through `Relay.move` (pre-warm, then cut over). The
policy states its reason with every move; it is logged.
"""

from __future__ import annotations

import asyncio
import logging

from proxy.policy import ClusterView
from proxy.policy.migration import MigrationSettings, RequestLoad, plan_migrations, sources
from proxy.relay import Relay

log = logging.getLogger("ferry.rescheduler")


class Rescheduler:
    def __init__(
        self,
        relay: Relay,
        settings: MigrationSettings,
        *,
        interval_s: float,
        max_concurrent: int,
    ) -> None:
        self.relay = relay
        self.settings = settings
        self.interval_s = interval_s
        self.max_concurrent = max_concurrent
        self._moving: set[asyncio.Task[bool]] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="rescheduler")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._moving) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.tick()

    def tick(self) -> int:
        """Plan and start moves; returns how many were started."""
        room = self.max_concurrent - len(self._moving)
        if room <= 0:
            return 0
        relay = self.relay
        usable = relay.migration_instances()
        full = relay.cluster.view()
        view = ClusterView(tuple(v for v in full.instances if v.name in usable), full.dispatch_seq)
        names = sources(view, self.settings)
        if not names:
            return 0
        streams = {n: relay.streams_on(n) for n in names}
        candidates = {
            n: [
                RequestLoad(
                    s.state.id,
                    len(s.state.prompt_ids or ()) + len(s.state.generated) or s.entry.prompt_tokens,
                    s.state.priority,
                    running=bool(s.state.generated),
                )
                for s in found
                if s.movable
            ]
            for n, found in streams.items()
        }
        block_size = {n: relay.cluster.block_size(n) for n in names}
        by_id = {s.state.id: s for found in streams.values() for s in found}
        plan = plan_migrations(view, candidates, block_size, self.settings)[:room]
        for move in plan:
            log.info(
                "rebalance: request %s %s -> %s: %s",
                move.request_id,
                move.source,
                move.destination,
                move.reason,
            )
            task = asyncio.create_task(
                relay.move(by_id[move.request_id], move.destination, "rebalance")
            )
            self._moving.add(task)
            task.add_done_callback(self._moving.discard)
        return len(plan)
