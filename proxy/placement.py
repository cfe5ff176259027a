"""Placement: the policy core's decision over the live view, timed and counted.

The relay places new requests with `choose`; the migrator places moved and
resumed streams with `destination`, among the instances that can take a move.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.cluster import Cluster
from proxy.metrics import FerryMetrics
from proxy.policy import ClusterView, DispatchRequest, InstanceView, NoCandidate, Priority, dispatch
from proxy.policy.policies import DispatchPolicy, best
from proxy.prefix_index import PrefixKey, session_of


class Placement:
    def __init__(
        self,
        cluster: Cluster,
        policy: DispatchPolicy,
        metrics: FerryMetrics,
        rng: random.Random,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self.metrics = metrics
        self.rng = rng

    def choose(
        self, request: DispatchRequest, key: PrefixKey | None = None, reach: int | None = None
    ) -> tuple[InstanceView, int]:
        """The instance for `request` and how many of its prompt tokens it probably
        caches; raises `NoCandidate`. With the prefix index on, `key` (the
        request's prefix) gives each candidate its cached length and the session's
        last instance, and is recorded on the one chosen. `reach` (its prompt and
        the budget it asks for) passes over instances whose context would trim
        that budget, unless none that holds it can take the request."""
        short = self.short_contexts(request.model, reach) - request.exclude if request.model else ()
        if short:
            fitting = dataclasses.replace(request, exclude=request.exclude | short)
            try:
                return self._choose(fitting, key)
            except NoCandidate:
                pass  # vLLM trims its budget wherever it goes
        return self._choose(request, key)

    def _choose(self, request: DispatchRequest, key: PrefixKey | None) -> tuple[InstanceView, int]:
        started = time.perf_counter()
        view = self.cluster.view()
        prefixes = self.cluster.prefixes
        if key is not None and prefixes.enabled:
            cached = prefixes.cached_tokens(key)
            affinity = prefixes.affinity(key)
            if cached or affinity:
                request = dataclasses.replace(request, cached_tokens=cached, affinity=affinity)
        chosen = dispatch(self.policy, request, view, self.rng)
        self.cluster.note_dispatch()
        if key is not None and prefixes.enabled:
            prefixes.record(chosen.name, key, chosen.capacity_blocks, chosen.block_size)
        self.metrics.decision.observe(time.perf_counter() - started)
        return chosen, request.cached_tokens.get(chosen.name, 0)

    def prefix_key(
        self, body: dict[str, Any] | None, prompt_tokens: int, session_header: str | None
    ) -> PrefixKey | None:
        """A request's prefix (text chunks and session); None with the index off."""
        prefixes = self.cluster.prefixes
        if not prefixes.enabled or body is None:
            return None
        return prefixes.key(body, prompt_tokens, session_of(body, session_header))

    def record_prompt_ids(self, name: str, ids: Sequence[int]) -> None:
        """The engine reported a request's prompt ids on `name`: index its blocks."""
        prefixes = self.cluster.prefixes
        if prefixes.enabled and name in self.cluster.instances:
            # From the snapshot, not `instance_view`: this runs at every stream's
            # first event, just after the ledger changed, and a view would be
            # rebuilt for two numbers that did not.
            snap = self.cluster.instances[name].snapshot
            capacity = snap.kv_blocks_total if snap else 0
            prefixes.record_tokens(name, ids, self.cluster.block_size(name), capacity)

    def migration_instances(self) -> set[str]:
        """Instances that can take part in a move (as source or destination)."""
        return {
            name
            for name, state in self.cluster.instances.items()
            if state.config.migration != "off" and state.healthy and not state.draining
        }

    def takes_moves(self, name: str) -> bool:
        """Whether `name` may be a move's destination now: a migration instance
        (`migration_instances`) not ejected. An ejected one stays a source: its
        streams may move off it."""
        return name in self.migration_instances() and not self.cluster.ejected_for(name)

    def view_of(self, names: set[str]) -> ClusterView:
        """The live view over the instances in `names` (a move's possible sources
        and destinations)."""
        full = self.cluster.view()
        return ClusterView(tuple(v for v in full.instances if v.name in names), full.dispatch_seq)

    def destination(
        self,
        model: str,
        tokens: int,
        priority: Priority,
        exclude: set[str],
        preferred: str | None = None,
        cached: Mapping[str, int] | None = None,
        rescue: bool = False,
        reach: int | None = None,
        staged: bool = False,
    ) -> str | None:
        """Where a stream of `tokens` (prompt + generated) should go on: `preferred`
        if it can take it, else the policy's pick among migration instances;
        `cached` (from `cached_for`) credits the instances holding its prefix.
        A `rescue` (a broken stream's failover) that finds none of those takes a
        draining instance, the one with the fewest in flight: it is healthy, and
        its drain waits for the stream or moves it on, where the alternative is
        to lose the stream. Not one drained to be removed: it may be gone
        before the stream starts there. Never one whose context is shorter than
        the stream's `reach` (see `short_contexts`). `staged`: the stream's KV
        waits at `preferred` (full mode, its source stopped), which takes it
        even while it drains, as a rescue would: the move is half done."""
        exclude = exclude | self.short_contexts(model, reach)
        usable = self.migration_instances()
        if preferred and preferred not in exclude:
            if preferred in usable and not self.cluster.ejected_for(preferred):  # (takes_moves)
                return preferred
            if staged and any(v.name == preferred for v in self._draining(model, exclude)):
                return preferred
        skip = frozenset(exclude | (set(self.cluster.instances) - usable))
        request = DispatchRequest(
            model, tokens, priority, skip, cached_tokens=cached or {}, panic=rescue
        )
        try:
            return self.choose(request)[0].name
        except NoCandidate:
            return self._draining_destination(model, exclude) if rescue else None

    def short_contexts(self, model: str, reach: int | None) -> frozenset[str]:
        """Instances whose context for `model` is known and shorter than `reach`
        tokens: a stream that may grow to `reach` would be cut short there
        (vLLM trims a budget to the context left, and says "length")."""
        if reach is None:
            return frozenset()
        lengths, shortest = self.cluster.contexts(model)
        if reach <= shortest:  # (most fleets: one context, and requests that fit it)
            return frozenset()
        return frozenset(n for n, length in lengths.items() if length < reach)

    def rescue(self, model: str | None, exclude: frozenset[str]) -> InstanceView | None:
        """Where a request whose instance failed it goes when no other instance
        takes new ones: a draining instance (see `destination`'s rescue), which
        answers it rather than it being lost. None for a request that names no
        model (a pass-through)."""
        if model is None:
            return None
        return self._least_busy(self._draining(model, set(exclude), moves=False))

    def _draining(self, model: str, exclude: set[str], moves: bool = True) -> list[InstanceView]:
        """Draining instances that may still take a stream of `model` (`moves`:
        a moved one, so only those with migration on)."""
        instances = self.cluster.instances
        return [
            v
            for v in self.cluster.view().instances
            if v.draining
            and v.healthy  # not ejected either
            and v.name not in exclude
            and model in v.models
            and (not moves or instances[v.name].config.migration != "off")
            and not instances[v.name].leaving
        ]

    def _draining_destination(self, model: str, exclude: set[str]) -> str | None:
        chosen = self._least_busy(self._draining(model, exclude))
        return None if chosen is None else chosen.name

    def _least_busy(self, views: list[InstanceView]) -> InstanceView | None:
        if not views:
            return None
        # Freeness is -inf while draining: the fewest in flight instead.
        return best(views, [-float(v.inflight) for v in views], self.rng)

    def cached_for(self, ids: Sequence[int], instance: str) -> dict[str, int]:
        """Tokens of the id sequence `ids` (a stream's prompt + generated) that the
        prefix index places on each instance, in `instance`'s block size."""
        prefixes = self.cluster.prefixes
        if not prefixes.enabled or not ids or instance not in self.cluster.instances:
            return {}
        size = self.cluster.block_size(instance)
        return prefixes.cached_token_blocks(ids, size, self.cluster.instances)
