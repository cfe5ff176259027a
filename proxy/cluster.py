"""Cluster state: each instance's last snapshot and health, joined with the ledger.

The scheduler reads `view()`: an immutable `ClusterView` rebuilt lazily, one
instance at a time, only for instances whose inputs changed (a scrape, a
dispatch, a release, a request crossing a KV block boundary, the peers' totals).
A decision over N instances therefore costs one tuple lookup plus the policy's
one pass.

With a shared view (proxy/sharing.py) an instance's load is this process's
ledger plus the totals its peers published (`set_peer_load`); the engine's own
report counts as traffic from outside Ferry only beyond both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from adapters import EngineAdapter, EngineSnapshot, get_adapter
from proxy.config import InstanceConfig
from proxy.ejection import Ejection, EjectionSettings
from proxy.ledger import Ledger, LedgerEntry
from proxy.peer_load import NO_LOAD, InstanceLoad
from proxy.policy import ClusterView, InstanceView, UsageSettings
from proxy.policy.virtual_usage import instance_view
from proxy.prefix_index import PrefixIndex

log = logging.getLogger("ferry.cluster")


@dataclass(slots=True)
class InstanceState:
    config: InstanceConfig
    snapshot: EngineSnapshot | None = None
    snapshot_at: float | None = None  # monotonic seconds of the last good scrape
    healthy: bool = False  # until the first good scrape
    draining: bool = False
    leaving: bool = False  # drained to be removed once empty: takes no stream at all
    failures: int = 0  # consecutive failed scrapes
    last_error: str | None = None
    down_logged: bool = False  # this outage is in the log
    models: frozenset[str] = frozenset()
    model_cards: tuple[dict[str, Any], ...] = ()
    # Why its last `GET /v1/models` failed (None: it answered). Its load may
    # still be read, and it takes no request for a model it has not listed.
    models_error: str | None = None
    # Its engine said it does not serve a model listed for it (restarted on its
    # port with another, say): its models are read again at the next look.
    models_stale: bool = False
    # Load the engine reports beyond Ferry's ledger (traffic bypassing the proxy),
    # measured at the last scrape and carried until the next one.
    external_blocks: float = 0.0
    external_requests: int = 0
    # What the last scrape showed beyond Ferry's ledgers (with a shared view, an
    # engine's load counts as from outside only if two scrapes in a row show it).
    gap_blocks: float = 0.0
    gap_requests: int = 0
    # What migration_shim says of itself (GET /ferry/shim/info); None: no shim seen.
    shim: dict[str, Any] | None = None
    shim_error: str | None = None
    # Where its metrics are read (the scraper's choice): the adapter's narrow path
    # once a look there read as the full page does, else the full page.
    metrics_path: str | None = None
    ejection: Ejection = field(default_factory=Ejection)  # upstream call failures
    # `config.server`, read once: a fleet's every change compares it with every
    # instance's, and parsing a URL a thousand times a change was seconds.
    server: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        self.server = self.config.server

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
        ejection: EjectionSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.instances = {c.name: InstanceState(c) for c in instances}
        self.ledger = Ledger(on_change=self._invalidate)
        self.usage = usage
        self.unhealthy_after_failures = unhealthy_after_failures
        self.ejection = ejection or EjectionSettings()
        self.clock = clock
        self.dispatch_seq = 0
        self.prefixes = PrefixIndex(enabled=False)  # placement turns it on (proxy/prefix_index.py)
        self._ejected: dict[str, float] = {}  # name -> ejected until
        # model -> (each instance's context for it where its card says, the
        # shortest): read per request, changed only when a card or the fleet does.
        self._contexts: dict[str, tuple[dict[str, int], int]] = {}
        # The cache sizes (tokens, block size) of the engines that publish one,
        # their mean in tokens and their median block size: the size an engine
        # that publishes none is ranked by (`_build`), and the blocks it is
        # billed in where it says no block size (freeness is blocks per
        # request: in 16-token blocks beside 128-token ones it read 8x freer).
        self._capacities: dict[str, tuple[int, int]] = {}
        self._assumed_tokens = 0
        self._assumed_block = 0
        # Other Ferry processes' in-flight totals by instance (proxy/peer_load.py),
        # and whether there are any (proxy/sharing.py sets it).
        self.peer_load: dict[str, InstanceLoad] = {}
        self.shared = False
        self._index: dict[str, int] = {}  # name -> its place in `_views`
        self._views: list[InstanceView] = []
        self._reindex()

    def view(self) -> ClusterView:
        if self._ejected:
            now = self.clock()
            for name, until in list(self._ejected.items()):
                if now >= until:  # back: its view turns dispatchable
                    del self._ejected[name]
                    self._invalidate(name)
        if self._stale:
            for name in self._stale:
                if name in self._index:  # a removed instance's last release
                    self._views[self._index[name]] = self._build(self.instances[name])
            self._stale.clear()
            self._all = tuple(self._views)
        return ClusterView(self._all, self.dispatch_seq)

    def retune(
        self, usage: UsageSettings, unhealthy_after_failures: int, ejection: EjectionSettings
    ) -> None:
        """New scheduler settings (a reload): every view is rebuilt, if they changed."""
        if (usage, unhealthy_after_failures, ejection) == (
            self.usage,
            self.unhealthy_after_failures,
            self.ejection,
        ):
            return  # (each fleet change retunes: a thousand rebuilds each, for nothing)
        self.usage, self.unhealthy_after_failures = usage, unhealthy_after_failures
        self.ejection = ejection
        self._stale.update(self.instances)

    # -- outlier ejection (proxy/ejection.py) ---------------------------------------
    def record_call_failure(self, name: str, error: str) -> bool:
        """A call failed on the instance's side; True when that ejects it now."""
        state = self.instances.get(name)
        if state is None:
            return False
        state.last_error = error
        if not state.ejection.failure(self.clock(), self.ejection, self._has_spare(name)):
            return False
        self._ejected[name] = state.ejection.until
        self._invalidate(name)
        return True

    def contexts(self, model: str) -> tuple[dict[str, int], int]:
        """The context each instance serving `model` gives it, where its card
        says (`context_length`), and the shortest of them (0 when none says)."""
        known = self._contexts.get(model)
        if known is None:
            lengths = {
                name: length
                for name, state in self.instances.items()
                if model in state.models and (length := self.context_length(name, model))
            }
            known = self._contexts[model] = (lengths, min(lengths.values(), default=0))
        return known

    def context_length(self, name: str, model: str) -> int | None:
        """The longest sequence `model` takes on the instance (its card's
        `max_model_len`, as vLLM lists it; a LoRA adapter's card has none, and
        names its base model as `parent`), or None when it does not say."""
        cards = self.instances[name].model_cards
        card = next((c for c in cards if c.get("id") == model), None)
        # (vLLM lists an adapter's `max_model_len` as null.)
        mine = None if card is None else card.get("max_model_len")
        parent = None if card is None or type(mine) is int else card.get("parent")
        if isinstance(parent, str):
            card = next((c for c in cards if c.get("id") == parent), None)
        length = None if card is None else card.get("max_model_len")
        return length if type(length) is int else None  # (not a JSON `true`)

    def _has_spare(self, name: str) -> bool:
        """Whether each model of the instance has another instance to go to. The
        last one standing is never ejected, as Envoy's panic threshold keeps
        hosts in use: with nowhere else to send them, requests are better sent
        to an instance that fails some of them than refused."""
        others = [
            s
            for n, s in self.instances.items()
            if n != name and s.healthy and not s.draining and n not in self._ejected
        ]
        return all(any(m in s.models for s in others) for m in self.instances[name].models)

    def record_call_success(self, name: str) -> None:
        state = self.instances.get(name)
        if state is not None:
            state.ejection.success(self.clock(), self.ejection)

    # -- the instance set, changed at runtime (proxy/fleet.py) ------------------------
    def add(self, config: InstanceConfig) -> InstanceState:
        """A new instance; it takes no traffic until its first good scrape."""
        state = self.instances[config.name] = InstanceState(config)
        self._contexts.clear()
        self._assume_block_size(config.name, state)
        # The others' views stand: one more built, not all of them again.
        self._index[config.name] = len(self._views)
        self._views.append(self._build(state))
        self._all = tuple(self._views)
        return state

    def remove(self, name: str) -> None:
        """Forget an instance (the caller drained it: nothing of it is in flight)."""
        del self.instances[name]
        self._contexts.clear()
        self.ledger.forget(name)
        self.prefixes.forget(name)
        self._ejected.pop(name, None)
        self._note_capacity(name)
        del self._views[self._index.pop(name)]
        self._index = {other: i for i, other in enumerate(self.instances)}
        self._stale.discard(name)
        self._all = tuple(self._views)

    def reconfigure(self, config: InstanceConfig) -> None:
        """Swap an instance's settings. A new URL or engine is a new server: it
        takes no traffic until that server answers a scrape."""
        state = self.instances[config.name]
        if config.engine_at != state.config.engine_at:
            state.snapshot = state.snapshot_at = state.shim = None
            state.healthy, state.failures = False, 0
            state.models, state.model_cards = frozenset(), ()
            self._contexts.clear()
            state.ejection = Ejection()
            self._ejected.pop(config.name, None)
            self.prefixes.forget(config.name)  # a new server's cache starts empty
            self._note_capacity(config.name)
        state.config, state.server = config, config.server
        self._invalidate(config.name)

    def _reindex(self) -> None:
        self._index = {name: i for i, name in enumerate(self.instances)}
        self._views = [self._build(state) for state in self.instances.values()]
        self._stale: set[str] = set()
        self._all = tuple(self._views)

    def instance_view(self, name: str) -> InstanceView:
        return self.view().instances[self._index[name]]

    def release(self, entry: LedgerEntry) -> None:
        """A call ended: its load leaves the ledger, and the blocks of what it
        generated take their room in the prefix index's picture of the cache."""
        self.ledger.release(entry)
        if entry.instance in self.instances:
            size = self.block_size(entry.instance)
            self.prefixes.record_generated(entry.instance, entry.generated_tokens, size)

    def block_size(self, name: str) -> int:
        snap = self.instances[name].snapshot
        return snap.block_size if snap and snap.block_size else self._assumed_block or 16

    def record_scrape(
        self, name: str, snapshot: EngineSnapshot, now: float, reached_id: int = 0
    ) -> None:
        """A look at the engine; the ledger's requests up to id `reached_id` had
        reached it before the look (their answers' starts are read off its queue)."""
        state = self.instances[name]
        state.snapshot, state.snapshot_at = snapshot, now
        self._note_capacity(name)
        self._up(name, state)
        self.ledger.set_block_size(name, snapshot.block_size)
        in_order = snapshot.engines == 1 and not state.config.engine_priority
        self.ledger.settle_unwatched(name, snapshot.waiting, reached_id, in_order)
        peers = self.peer_load.get(name, NO_LOAD)
        ferry_blocks = self.ledger.blocks(name) + peers.blocks
        gap_blocks = max(0.0, snapshot.kv_blocks_used - ferry_blocks)
        gap_requests = max(
            0, snapshot.running + snapshot.waiting - self.ledger.count(name) - peers.inflight
        )
        if self.shared:
            # A peer's dispatch can reach the engine a few ms before its announcement
            # reaches this process; counted as outside traffic, it would count twice
            # until the next scrape, on whichever instance it landed (measured: bursts
            # then pile 6 requests where 3 belong). Traffic that truly bypasses
            # Ferry is still there one scrape later.
            state.external_blocks = min(gap_blocks, state.gap_blocks)
            state.external_requests = min(gap_requests, state.gap_requests)
        else:
            state.external_blocks, state.external_requests = gap_blocks, gap_requests
        state.gap_blocks, state.gap_requests = gap_blocks, gap_requests
        self._invalidate(name)

    def record_alive(self, name: str, now: float) -> None:
        """A good health probe of an engine without metrics: healthy, and its load
        is Ferry's ledger alone (no snapshot, so capacity 0: fewest in flight first)."""
        state = self.instances[name]
        state.snapshot_at = now
        self._up(name, state)
        state.external_blocks, state.external_requests = 0.0, 0
        self._invalidate(name)

    def _up(self, name: str, state: InstanceState) -> None:
        if not state.healthy:  # at start, and after an outage
            log.info("instance %s is healthy", name)
            # Down, it may have restarted with an empty cache: what Ferry
            # recorded of it (text chunks, token blocks) is no longer known to
            # be there. (A precise engine's own record follows its events.)
            self.prefixes.engine_cleared(name)
        state.failures, state.last_error, state.healthy = 0, None, True
        state.down_logged = False

    @staticmethod
    def _log_down(name: str, state: InstanceState, why: str) -> None:
        """One line an outage, however it shows (failed looks, failed connects)."""
        if not state.down_logged:
            state.down_logged = True
            log.warning("instance %s is %s: %s", name, why, state.last_error)

    def record_scrape_failure(self, name: str, error: str) -> None:
        state = self.instances[name]
        state.failures += 1
        state.last_error = error
        if state.failures >= self.unhealthy_after_failures:
            self._log_down(name, state, f"unhealthy after {state.failures} failed looks")
        if state.failures >= self.unhealthy_after_failures and state.healthy:
            self._down(name, state)

    def record_models(self, name: str, cards: list[dict[str, Any]]) -> None:
        state = self.instances[name]
        if tuple(cards) != state.model_cards:
            self._contexts.clear()
        state.model_cards = tuple(cards)
        state.models = frozenset(str(c.get("id")) for c in cards)
        self._invalidate(name)

    def mark_unreachable(self, name: str, error: str) -> None:
        """A connection to the instance failed: no traffic until a scrape succeeds."""
        state = self.instances[name]
        state.last_error = error
        if state.healthy:
            self._log_down(name, state, "unreachable, no traffic until it answers")
            self._down(name, state)

    def _down(self, name: str, state: InstanceState) -> None:
        """Unhealthy: the load its last look saw from outside Ferry is no longer
        known to be there (a dead engine's is gone), so it counts no more."""
        state.healthy = False
        state.external_blocks, state.external_requests = 0.0, 0
        state.gap_blocks, state.gap_requests = 0.0, 0
        self._invalidate(name)

    def set_draining(self, name: str, draining: bool) -> None:
        self.instances[name].draining = draining
        self._invalidate(name)

    def set_peer_load(self, load: dict[str, InstanceLoad]) -> None:
        """The peers' totals now; only the instances whose totals changed are rebuilt."""
        old, self.peer_load = self.peer_load, load
        for name in old.keys() | load.keys():
            if old.get(name) != load.get(name) and name in self.instances:
                self._invalidate(name)

    def local_load(self, name: str) -> InstanceLoad:
        """This process's ledger totals for an instance (what it publishes)."""
        ledger = self.ledger
        return InstanceLoad(
            ledger.blocks(name),
            ledger.count(name),
            ledger.high_priority(name),
            ledger.queued_tokens(name),
            ledger.waiting(name),
        )

    def note_dispatch(self) -> None:
        self.dispatch_seq += 1

    def ejected_for(self, name: str) -> float:
        """Seconds the instance stays ejected (0: it is not)."""
        return max(0.0, self._ejected.get(name, 0.0) - self.clock())

    def _invalidate(self, name: str) -> None:
        self._stale.add(name)

    def _note_capacity(self, name: str) -> None:
        """Keep `_capacities`, their mean and their median block size as `name`'s
        engine says its cache size (or no longer does); the engines that say
        none follow: their views, and the blocks they are billed in."""
        state = self.instances.get(name)
        snap = state.snapshot if state is not None else None
        size = None  # (tokens, block size)
        if snap is not None and snap.kv_blocks_total > 0:
            block = snap.block_size or 16
            size = (snap.kv_blocks_total * block, block)
        known = self._capacities
        if known.get(name) == size:
            return
        if size is None:
            del known[name]
        else:
            known[name] = size
        mean = sum(tokens for tokens, _ in known.values()) // len(known) if known else 0
        blocks = sorted(block for _, block in known.values())
        median = blocks[len(blocks) // 2] if blocks else 0
        if (mean, median) == (self._assumed_tokens, self._assumed_block):
            return
        self._assumed_tokens, self._assumed_block = mean, median
        for other, other_state in self.instances.items():
            if other not in known:
                self._assume_block_size(other, other_state)
                self._stale.add(other)

    def _assume_block_size(self, name: str, state: InstanceState) -> None:
        """Bill an engine that says no block size in the fleet's (`_capacities`)."""
        snap = state.snapshot
        if self._assumed_block and not (snap and snap.block_size):
            self.ledger.set_block_size(name, self._assumed_block)

    def _build(self, state: InstanceState) -> InstanceView:
        snap = state.snapshot
        name = state.name
        load = self.local_load(name)
        peers = self.peer_load.get(name)
        if peers is not None:
            load += peers
        block_size = self.block_size(name)
        return instance_view(
            name,
            capacity_blocks=snap.kv_blocks_total if snap else 0,
            assumed_capacity_blocks=self._assumed_tokens // block_size,
            real_blocks=state.external_blocks + load.blocks,
            high_priority_requests=load.high,
            batch=load.inflight + state.external_requests,
            inflight=load.inflight,
            settings=self.usage,
            kv_usage=snap.kv_usage if snap else 0.0,
            engine_running=snap.running if snap else 0,
            engine_waiting=snap.waiting if snap else 0,
            # The engine's queue beyond the requests the ledgers have waiting for a
            # first token, movable or not: streams it preempted, most likely.
            engine_preempted=max(0, snap.waiting - load.waiting) if snap else 0,
            queued_tokens=load.queued_tokens,
            block_size=block_size,
            healthy=state.healthy and name not in self._ejected,
            draining=state.draining,
            models=state.models,
            ejected=state.healthy and name in self._ejected,
        )
