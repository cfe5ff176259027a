"""Cluster state: each instance's last snapshot and health, joined with the ledger.

The scheduler reads `view()`: an immutable `ClusterView` rebuilt lazily, one
instance at a time, only for instances whose inputs changed (a scrape, a
dispatch, a release, a request crossing a KV block boundary). A decision over N
instances therefore costs one tuple lookup plus the policy's one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapters import EngineAdapter, EngineSnapshot, get_adapter
from proxy.config import InstanceConfig
from proxy.ledger import Ledger
from proxy.policy import ClusterView, InstanceView, UsageSettings
from proxy.policy.virtual_usage import instance_view


@dataclass(slots=True)
class InstanceState:
    config: InstanceConfig
    snapshot: EngineSnapshot | None = None
    snapshot_at: float | None = None  # monotonic seconds of the last good scrape
    healthy: bool = False  # until the first good scrape
    draining: bool = False
    failures: int = 0  # consecutive failed scrapes
    last_error: str | None = None
    models: frozenset[str] = frozenset()
    model_cards: tuple[dict[str, Any], ...] = ()
    # Load the engine reports beyond Ferry's ledger (traffic bypassing the proxy),
    # measured at the last scrape and carried until the next one.
    external_blocks: float = 0.0
    external_requests: int = 0
    # What migration_shim says of itself (GET /ferry/shim/info); None: no shim seen.
    shim: dict[str, Any] | None = None
    shim_error: str | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def url(self) -> str:
        return self.config.url.rstrip("/")

    @property
    def adapter(self) -> EngineAdapter:
        """What the instance's engine exposes (its `engine:`, checked at config load)."""
        return get_adapter(self.config.engine)

    @property
    def migration_mode(self) -> str:
        """The mode in effect: `full` needs the shim on the instance, else lite."""
        mode = self.config.migration
        return "lite" if mode == "full" and self.shim is None else mode


class Cluster:
    def __init__(
        self,
        instances: tuple[InstanceConfig, ...],
        usage: UsageSettings,
        unhealthy_after_failures: int,
    ) -> None:
        self.instances = {c.name: InstanceState(c) for c in instances}
        self.ledger = Ledger(on_change=self._invalidate)
        self.usage = usage
        self.unhealthy_after_failures = unhealthy_after_failures
        self.dispatch_seq = 0
        self._index = {name: i for i, name in enumerate(self.instances)}
        self._views = [self._build(state) for state in self.instances.values()]
        self._stale: set[str] = set()
        self._all = tuple(self._views)

    def view(self) -> ClusterView:
        if self._stale:
            for name in self._stale:
                self._views[self._index[name]] = self._build(self.instances[name])
            self._stale.clear()
            self._all = tuple(self._views)
        return ClusterView(self._all, self.dispatch_seq)

    def instance_view(self, name: str) -> InstanceView:
        return self.view().instances[self._index[name]]

    def block_size(self, name: str) -> int:
        snap = self.instances[name].snapshot
        return snap.block_size if snap and snap.block_size else 16

    def record_scrape(self, name: str, snapshot: EngineSnapshot, now: float) -> None:
        state = self.instances[name]
        state.snapshot, state.snapshot_at = snapshot, now
        state.failures, state.last_error, state.healthy = 0, None, True
        self.ledger.set_block_size(name, snapshot.block_size)
        state.external_blocks = max(0.0, snapshot.kv_blocks_used - self.ledger.blocks(name))
        state.external_requests = max(
            0, snapshot.running + snapshot.waiting - self.ledger.count(name)
        )
        self._invalidate(name)

    def record_alive(self, name: str, now: float) -> None:
        """A good health probe of an engine without metrics: healthy, and its load
        is Ferry's ledger alone (no snapshot, so capacity 0: fewest in flight first)."""
        state = self.instances[name]
        state.snapshot_at = now
        state.failures, state.last_error, state.healthy = 0, None, True
        state.external_blocks, state.external_requests = 0.0, 0
        self._invalidate(name)

    def record_scrape_failure(self, name: str, error: str) -> None:
        state = self.instances[name]
        state.failures += 1
        state.last_error = error
        if state.failures >= self.unhealthy_after_failures and state.healthy:
            state.healthy = False
            self._invalidate(name)

    def record_models(self, name: str, cards: list[dict[str, Any]]) -> None:
        state = self.instances[name]
        state.model_cards = tuple(cards)
        state.models = frozenset(str(c.get("id")) for c in cards)
        self._invalidate(name)

    def mark_unreachable(self, name: str, error: str) -> None:
        """A connection to the instance failed: no traffic until a scrape succeeds."""
        state = self.instances[name]
        state.last_error = error
        if state.healthy:
            state.healthy = False
            self._invalidate(name)

    def set_draining(self, name: str, draining: bool) -> None:
        self.instances[name].draining = draining
        self._invalidate(name)

    def note_dispatch(self) -> None:
        self.dispatch_seq += 1

    def _invalidate(self, name: str) -> None:
        self._stale.add(name)

    def _build(self, state: InstanceState) -> InstanceView:
        snap = state.snapshot
        name = state.name
        inflight = self.ledger.count(name)
        return instance_view(
            name,
            capacity_blocks=snap.kv_blocks_total if snap else 0,
            real_blocks=state.external_blocks + self.ledger.blocks(name),
            high_priority_requests=self.ledger.high_priority(name),
            batch=inflight + state.external_requests,
            inflight=inflight,
            settings=self.usage,
            kv_usage=snap.kv_usage if snap else 0.0,
            engine_running=snap.running if snap else 0,
            engine_waiting=snap.waiting if snap else 0,
            queued_tokens=self.ledger.queued_tokens(name),
            healthy=state.healthy,
            draining=state.draining,
            models=state.models,
        )
