"""The ledger: every request Ferry has in flight, by instance.

A request is recorded the moment it is dispatched (prompt tokens estimated),
corrected when the engine reports its prompt ids, credited per generated token
from the stream, and released on finish, error or client disconnect. The
scheduler reads it between scrapes, so a burst never piles onto an instance
whose last scrape looked idle.

`on_change(instance)` fires when something a view depends on changed: a
request came or went, started (its first token, or the engine's queue for an
answer Ferry sees only whole), or crossed a KV block boundary.
`on_count(instance)`, when set, fires only when a request came or went: a shared
view (proxy/sharing.py) tells its peers of those at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from proxy.policy import Priority
from proxy.policy.virtual_usage import request_blocks


@dataclass(slots=True)
class LedgerEntry:
    id: int
    instance: str
    model: str
    priority: Priority
    arrival: float  # monotonic seconds
    prompt_tokens: int
    cached_tokens: int = 0  # of the prompt, in the instance's prefix cache at dispatch
    prompt_exact: bool = False  # True once the engine reported prompt ids
    generated_tokens: int = 0
    # Started: a first token came, or, for an answer whose tokens Ferry sees
    # only at its end (`watched` False), the engine's queue says it was
    # scheduled (its prefill may still run, as a prefill between two looks does).
    started: bool = False
    watched: bool = True  # its tokens are seen as they come (a stream Ferry reads)
    blocks: int = 0  # KV blocks at the instance's block size, kept to detect crossings


class Ledger:
    def __init__(self, on_change: Callable[[str], None] = lambda _: None) -> None:
        self._by_instance: dict[str, dict[int, LedgerEntry]] = {}
        self._ids = itertools.count(1)
        self._on_change = on_change
        self.on_count: Callable[[str], None] | None = None
        self._block_size: dict[str, int] = {}
        # Running totals per instance, so a view is built in O(1), not O(requests).
        self._blocks_total: dict[str, int] = {}
        self._high: dict[str, int] = {}
        # Uncached prompt tokens of the requests not started yet: the prefill
        # still ahead.
        self._queued_tokens: dict[str, int] = {}
        self._waiting: dict[str, int] = {}  # requests not started yet
        self._produced: dict[str, int] = {}  # tokens generated so far, ever (see `produced`)
        self._last_id = 0

    def set_block_size(self, instance: str, block_size: int) -> None:
        if block_size > 0 and self._block_size.get(instance) != block_size:
            self._block_size[instance] = block_size
            for entry in self.entries(instance):
                self._set_blocks(entry, self._blocks(entry))
            self._on_change(instance)

    def add(
        self,
        instance: str,
        model: str,
        priority: Priority,
        prompt_tokens: int,
        now: float,
        cached_tokens: int = 0,
        watched: bool = True,
    ) -> LedgerEntry:
        self._last_id = entry_id = next(self._ids)
        entry = LedgerEntry(
            entry_id, instance, model, priority, now, prompt_tokens, cached_tokens, watched=watched
        )
        self._by_instance.setdefault(instance, {})[entry.id] = entry
        self._set_blocks(entry, self._blocks(entry))
        if priority is Priority.HIGH:
            self._high[instance] = self._high.get(instance, 0) + 1
        self._add_queued(entry, _prefill(entry))
        self._waiting[instance] = self._waiting.get(instance, 0) + 1
        self._on_change(instance)
        if self.on_count is not None:
            self.on_count(instance)
        return entry

    def set_prompt_tokens(self, entry: LedgerEntry, tokens: int) -> None:
        before = _prefill(entry)
        entry.prompt_tokens = tokens
        queued = not entry.started and _prefill(entry) != before
        if queued:
            self._add_queued(entry, _prefill(entry) - before)
        entry.prompt_exact = True
        self._rebill(entry)
        if queued and self._live(entry):
            self._on_change(entry.instance)

    def add_generated(self, entry: LedgerEntry, tokens: int) -> None:
        entry.generated_tokens += tokens
        self._produced[entry.instance] = self._produced.get(entry.instance, 0) + tokens
        if tokens > 0:
            self._start(entry)
        self._rebill(entry)

    def last_id(self) -> int:
        """The id of the latest dispatch: entries up to it were sent by now."""
        return self._last_id

    def settle_unwatched(
        self, instance: str, engine_waiting: int, reached_id: int, in_order: bool = True
    ) -> None:
        """Mark started the unwatched entries the engine's queue says have started.

        The engine reported `engine_waiting` requests not yet scheduled, in a
        look taken after every entry up to id `reached_id` had reached it. None
        waiting: all those have started. Where it schedules first come first
        served (`in_order`: one engine core, no priorities), at most the newest
        `engine_waiting` of them still wait, so an unwatched one older than that
        has started. Requests from elsewhere, preempted ones, and entries left
        out below only make fewer count as started. (vLLM passes over a request
        waiting for a grammar, a LoRA slot or remote KV, and one still in its
        API server after proxy/scraper.py's QUEUE_SHOWS_AFTER_S is not in the queue yet: those can
        count as started early.) Started here is scheduled: its prefill may
        still be running, as a prefill between two looks is. Without this an
        unwatched answer would count as a queued prefill until it ends, and the
        prefill-aware policy would avoid its instance all that while."""
        if self._waiting.get(instance, 0) <= engine_waiting:
            return  # all of them may still wait (and none does, often)
        if engine_waiting and not in_order:
            return
        # In id order (dict order: ids only grow). An entry with nothing to
        # prefill is left out: a call that never reaches the engine's queue
        # (`GET /version` through the pass-through) must not take the place
        # of an older request that is still in it.
        pending = [
            e
            for e in self._by_instance.get(instance, {}).values()
            if not e.started and e.id <= reached_id and _prefill(e) > 0
        ]
        for entry in pending[: max(0, len(pending) - engine_waiting)]:
            if not entry.watched:
                self._start(entry)

    def release(self, entry: LedgerEntry) -> None:
        requests = self._by_instance.get(entry.instance)
        if requests is not None and entry.id in requests:
            if not entry.started:
                self._add_queued(entry, -_prefill(entry))
                self._waiting[entry.instance] -= 1
            del requests[entry.id]
            self._blocks_total[entry.instance] -= entry.blocks
            if entry.priority is Priority.HIGH:
                self._high[entry.instance] -= 1
            self._on_change(entry.instance)
            if self.on_count is not None:
                self.on_count(entry.instance)

    def forget(self, instance: str) -> None:
        """Drop a removed instance's totals (it has nothing in flight)."""
        self._by_instance.pop(instance, None)
        for totals in (
            self._block_size,
            self._blocks_total,
            self._high,
            self._queued_tokens,
            self._waiting,
            self._produced,
        ):
            totals.pop(instance, None)

    def produced(self, instance: str) -> int:
        """Tokens the instance has streamed for this process's requests, movable or
        not (a whole answer's count when it ends): one that moves between two
        looks is still producing."""
        return self._produced.get(instance, 0)

    def entries(self, instance: str) -> Iterator[LedgerEntry]:
        return iter(list(self._by_instance.get(instance, {}).values()))

    def count(self, instance: str) -> int:
        return len(self._by_instance.get(instance, ()))

    def blocks(self, instance: str) -> int:
        """KV blocks held by the instance's in-flight requests (real usage)."""
        return self._blocks_total.get(instance, 0)

    def high_priority(self, instance: str) -> int:
        return self._high.get(instance, 0)

    def queued_tokens(self, instance: str) -> int:
        """Tokens the instance prefills before its queued requests' first tokens:
        their prompts less what was cached there at dispatch."""
        return self._queued_tokens.get(instance, 0)

    def waiting(self, instance: str) -> int:
        """Requests here not started yet (queued or prefilling in the engine)."""
        return self._waiting.get(instance, 0)

    def _live(self, entry: LedgerEntry) -> bool:
        return entry.id in self._by_instance.get(entry.instance, {})

    def _start(self, entry: LedgerEntry) -> None:
        """The entry started: its prompt is no longer ahead of the others'."""
        if entry.started:
            return
        entry.started = True
        self._add_queued(entry, -_prefill(entry))
        if self._live(entry):
            self._waiting[entry.instance] -= 1
            self._on_change(entry.instance)

    def _add_queued(self, entry: LedgerEntry, tokens: int) -> None:
        if tokens and self._live(entry):
            total = self._queued_tokens.get(entry.instance, 0)
            self._queued_tokens[entry.instance] = total + tokens

    def _blocks(self, entry: LedgerEntry) -> int:
        # 16 tokens is vLLM's GPU default, used until the first scrape says otherwise.
        size = self._block_size.get(entry.instance, 16)
        # Blocks of its prompt the instance cached already are shared, not its
        # demand (issue 13); if they were only free cached blocks, the engine's
        # usage shows them at the next scrape (Cluster.record_scrape's gap).
        shared = entry.cached_tokens // size
        return max(0, request_blocks(entry.prompt_tokens + entry.generated_tokens, size) - shared)

    def _set_blocks(self, entry: LedgerEntry, blocks: int) -> None:
        """Change an entry's blocks, keeping the instance total in step (live entries only)."""
        if entry.id in self._by_instance.get(entry.instance, {}):
            total = self._blocks_total.get(entry.instance, 0)
            self._blocks_total[entry.instance] = total + blocks - entry.blocks
        entry.blocks = blocks

    def _rebill(self, entry: LedgerEntry) -> None:
        blocks = self._blocks(entry)
        if blocks != entry.blocks:
            live = entry.id in self._by_instance.get(entry.instance, {})
            self._set_blocks(entry, blocks)
            if live:
                self._on_change(entry.instance)


def _prefill(entry: LedgerEntry) -> int:
    return max(0, entry.prompt_tokens - entry.cached_tokens)
