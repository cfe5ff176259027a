"""The precise prefix index (proxy/engine_blocks.py) against synthetic event streams.

`ModelEngine` is a stand-in for a vLLM engine's block pool, not vLLM: a prefix
cache keyed by vLLM's own block hashes (adapters/vllm_kv_events.py) that
publishes numbered batches the way the engine does (a new run of blocks after
the longest cached prefix, chained on its parent; single removals; clears) and
keeps every batch for replay. The truth for a lookup is what that cache holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.kv_events import AllCleared, BlocksRemoved, BlocksStored, KVEvent
from adapters.vllm_kv_events import DEFAULT_SEED, FORMAT
from proxy.engine_blocks import EngineBlocks

SIZE = 4  # tokens a block
BASE = list(range(100, 140))  # shared by every prompt, so prompts share prefixes


class ModelEngine:
    def __init__(self, seed: str = DEFAULT_SEED, first_seq: int = 0) -> None:
        self.seed = seed
        self.held: set[int] = set()
        self.order: list[int] = []  # held hashes, oldest first (what eviction picks from)
        self.batches: list[tuple[int, list[KVEvent]]] = []
        self.first_seq = first_seq

    def hashes(self, ids: Sequence[int]) -> list[int]:
        return list(FORMAT.block_hashes(ids, SIZE, self.seed))

    def truth(self, ids: Sequence[int]) -> int:
        """What the engine reuses: held blocks within the first len - 1 tokens."""
        n = 0
        for h in self.hashes(ids[: len(ids) - 1]):
            if h not in self.held:
                break
            n += 1
        return n * SIZE

    def store(self, ids: Sequence[int]) -> tuple[int, list[KVEvent]]:
        hashes = self.hashes(ids)
        k = 0
        while k < len(hashes) and hashes[k] in self.held:
            k += 1
        events: list[KVEvent] = []
        if k < len(hashes):
            new = hashes[k:]
            parent = hashes[k - 1] if k else None
            tokens = tuple(ids[k * SIZE : len(hashes) * SIZE])
            events.append(BlocksStored(tuple(new), parent, tokens, SIZE))
            for h in new:
                if h not in self.held:
                    self.held.add(h)
                    self.order.append(h)
        return self.publish(events)

    def evict(self, pick: int) -> tuple[int, list[KVEvent]]:
        events: list[KVEvent] = []
        if self.order:
            h = self.order.pop(pick % len(self.order))
            self.held.discard(h)
            events.append(BlocksRemoved((h,)))
        return self.publish(events)

    def clear(self) -> tuple[int, list[KVEvent]]:
        self.held.clear()
        self.order.clear()
        return self.publish([AllCleared()])

    def publish(self, events: list[KVEvent]) -> tuple[int, list[KVEvent]]:
        batch = (self.first_seq + len(self.batches), events)
        self.batches.append(batch)
        return batch

    def replay(self, start: int, keep: int | None = None) -> list[tuple[int, list[KVEvent]]]:
        """What the replay endpoint answers: the buffered batches from `start`
        (only the last `keep` are buffered, like vLLM's buffer_steps)."""
        buffered = self.batches if keep is None else self.batches[-keep:]
        return [b for b in buffered if b[0] >= start]


def prompt(cut: int, tail: int, length: int) -> list[int]:
    return (BASE[:cut] + [tail] * 40)[:length]


# One step of an engine's life: store a prompt, evict a block, or clear.
Op = tuple[Any, ...]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 40), st.integers(0, 3), st.integers(0, 48)),
        st.tuples(st.just("evict"), st.integers(0, 1000)),
        st.tuples(st.just("clear")),
    ),
    max_size=40,
)
QUERIES = [prompt(c, t, 48) for c in (0, 8, 20, 40) for t in range(4)]


def run_op(engine: ModelEngine, op: Op) -> tuple[int, list[KVEvent]]:
    if op[0] == "store":
        return engine.store(prompt(op[1], op[2], op[3]))
    if op[0] == "evict":
        return engine.evict(op[1])
    return engine.clear()


def deliver(blocks: EngineBlocks, engine: ModelEngine, batch: tuple[int, list[KVEvent]]) -> None:
    """What the subscriber does with one live batch (replay from the engine's buffer)."""
    seq, events = batch
    start = blocks.receive(seq, events)
    if start is not None:
        for replayed in engine.replay(start):
            if not blocks.replayed(*replayed):
                blocks.lost(replayed[0])
                blocks.replayed(*replayed)
        blocks.replay_done()
        if blocks.next_seq is None or blocks.next_seq < seq:
            blocks.lost(seq)
        blocks.receive(seq, events)


def cached(blocks: EngineBlocks, ids: Sequence[int]) -> int:
    return blocks.cached_tokens(ids, {})


def connected(blocks: EngineBlocks, engine: ModelEngine) -> None:
    blocks.reset()
    start = blocks.begin_replay(0)
    for batch in engine.replay(start):
        if not blocks.replayed(*batch):
            blocks.lost(batch[0])
            blocks.replayed(*batch)
    blocks.replay_done()


@settings(max_examples=60, deadline=None)
@given(ops)
def test_in_order_the_index_is_the_engines_cache(steps: list[Op]) -> None:
    engine, blocks = ModelEngine(), EngineBlocks(FORMAT)
    connected(blocks, engine)
    for op in steps:
        deliver(blocks, engine, run_op(engine, op))
        assert set(blocks.held) == engine.held
        for q in QUERIES:
            assert cached(blocks, q) == engine.truth(q)
    assert blocks.complete and blocks.synced


@settings(max_examples=60, deadline=None)
@given(ops, st.sets(st.integers(0, 39)))
def test_dropped_batches_are_replayed(steps: list[Op], dropped: set[int]) -> None:
    engine, blocks = ModelEngine(), EngineBlocks(FORMAT)
    connected(blocks, engine)
    for i, op in enumerate(steps):
        batch = run_op(engine, op)
        if i not in dropped:
            deliver(blocks, engine, batch)
    # One more batch after the last drop brings the index up to date.
    deliver(blocks, engine, engine.publish([]))
    assert set(blocks.held) == engine.held
    assert blocks.lost_gaps == 0 and blocks.complete
    for q in QUERIES:
        assert cached(blocks, q) == engine.truth(q)


@settings(max_examples=60, deadline=None)
@given(ops, st.sets(st.integers(0, 39)), st.integers(0, 5))
def test_a_gap_the_buffer_lost_never_claims_a_block_the_engine_dropped(
    steps: list[Op],
    dropped: set[int],
    keep: int,
) -> None:
    engine, blocks = ModelEngine(), EngineBlocks(FORMAT)
    connected(blocks, engine)
    for i, op in enumerate(steps):
        seq, events = run_op(engine, op)
        if i in dropped:
            continue
        start = blocks.receive(seq, events)
        if start is not None:  # the engine kept only its last `keep` batches
            for batch in engine.replay(start, keep):
                if not blocks.replayed(*batch):
                    blocks.lost(batch[0])
                    blocks.replayed(*batch)
            if blocks.next_seq is None or blocks.next_seq < seq:
                blocks.lost(seq)
            blocks.receive(seq, events)
        assert set(blocks.held) <= engine.held
        for q in QUERIES:
            assert cached(blocks, q) <= engine.truth(q)


def test_a_lost_gap_clears_and_rebuilds_from_what_follows() -> None:
    engine, blocks = ModelEngine(), EngineBlocks(FORMAT)
    connected(blocks, engine)
    deliver(blocks, engine, engine.store(prompt(40, 0, 40)))
    engine.evict(0)  # missed, and gone from the engine's buffer
    seq, events = engine.store(prompt(8, 1, 40))
    assert blocks.receive(seq, events) == 1  # a gap from 1
    blocks.lost(seq)  # the replay could not fill it
    assert blocks.receive(seq, events) is None
    assert blocks.lost_gaps == 1 and not blocks.complete and blocks.synced
    # What was stored before the gap is forgotten (beyond the two blocks the later
    # store names again); what came after is known.
    assert cached(blocks, prompt(40, 0, 40)) == 8 < engine.truth(prompt(40, 0, 40)) == 36
    assert cached(blocks, prompt(8, 1, 40)) == engine.truth(prompt(8, 1, 40)) == 36
    # A clear makes the record whole again.
    deliver(blocks, engine, engine.clear())
    assert blocks.complete


def test_an_engine_restart_starts_the_record_again() -> None:
    old, blocks = ModelEngine(), EngineBlocks(FORMAT)
    connected(blocks, old)
    for cut in (40, 20, 8):
        deliver(blocks, old, old.store(prompt(cut, 0, 40)))
    assert cached(blocks, prompt(40, 0, 40)) == 36  # 10 blocks held; the last token is computed
    new = ModelEngine()  # the process restarted: seq 0 again, an empty cache
    new.store(prompt(8, 2, 40))  # seq 0, missed while reconnecting
    deliver(blocks, new, new.store(prompt(20, 3, 40)))  # seq 1 < expected: a restart
    assert blocks.restarts == 1 and blocks.clears == 1 and blocks.complete
    assert set(blocks.held) == new.held
    # Only the 20 shared tokens the new process stored, not the old process's 40.
    assert cached(blocks, prompt(40, 0, 40)) == new.truth(prompt(40, 0, 40)) == 20


def test_a_restart_seen_on_reconnection_without_a_replay_endpoint_clears_the_record() -> None:
    """With KV events but no replay endpoint, a reconnection follows what comes:
    the new process's seq 0 was taken for a first batch, and the old process's
    blocks (and Ferry's text chunks, on `clears`) stayed credited."""
    old, blocks = ModelEngine(), EngineBlocks(FORMAT)
    connected(blocks, old)
    deliver(blocks, old, old.store(prompt(40, 0, 40)))
    assert cached(blocks, prompt(40, 0, 40)) == 36
    blocks.reset()  # disconnected, then connected again: no replay to ask
    blocks.follow()
    new = ModelEngine()  # restarted: seq 0 again, an empty cache
    deliver(blocks, new, new.store(prompt(8, 1, 40)))
    assert blocks.restarts == 1 and blocks.clears == 1
    # Only the 8 shared tokens the new process stored, not the old process's 40.
    assert cached(blocks, prompt(40, 0, 40)) == new.truth(prompt(40, 0, 40)) == 8


def test_a_restart_seen_on_reconnection_learns_how_the_new_process_hashes() -> None:
    """The old process hashed as Ferry does, the new one with another seed
    (PYTHONHASHSEED): found on reconnection, the restart kept the old process's
    hashing, and every lookup there found nothing while the engine held 36."""
    old, blocks = ModelEngine(), EngineBlocks(FORMAT)
    connected(blocks, old)
    for _ in range(3):
        deliver(blocks, old, old.store(prompt(40, 0, 40)))
    assert blocks.hashing == "engine"
    reached = blocks.reached
    new = ModelEngine("another seed")
    new.store(prompt(40, 0, 40))  # seq 0 of the new process, while Ferry was away
    connected(blocks, new)
    assert blocks.restarted_while_away(reached) and blocks.hashing == "tokens"
    assert cached(blocks, prompt(40, 0, 40)) == new.truth(prompt(40, 0, 40)) == 36


def test_a_partial_block_leaves_the_engines_block_size_alone() -> None:
    """vLLM 0.32 publishes a hybrid model's partial blocks with their own, smaller
    size: one such store made every later lookup hash blocks of that size."""
    engine, blocks = ModelEngine(), EngineBlocks(FORMAT)
    connected(blocks, engine)
    deliver(blocks, engine, engine.store(prompt(40, 0, 40)))
    assert cached(blocks, prompt(40, 0, 40)) == 36
    other = prompt(9, 1, 9)
    half = tuple(FORMAT.block_hashes(other, SIZE // 2, DEFAULT_SEED))[:1]
    partial = BlocksStored(half, None, tuple(other[: SIZE // 2]), SIZE // 2)
    deliver(blocks, engine, engine.publish([partial]))
    assert blocks.block_size == SIZE and cached(blocks, prompt(40, 0, 40)) == 36


def test_a_replays_overlap_is_not_taken_for_a_restart() -> None:
    engine, blocks = ModelEngine(), EngineBlocks(FORMAT)
    connected(blocks, engine)
    deliver(blocks, engine, engine.store(prompt(8, 0, 16)))  # seq 0
    missed = [engine.store(prompt(20, t, 40)) for t in (1, 2)]  # 1, 2: missed
    live = engine.store(prompt(40, 3, 48))  # 3: arrives, replay brings 1..3
    deliver(blocks, engine, live)
    assert blocks.next_seq == 4
    # The subscriber's queue still held 2 (a late copy): skipped, not a restart.
    assert blocks.receive(*missed[1]) is None
    assert blocks.restarts == 0 and set(blocks.held) == engine.held
    deliver(blocks, engine, engine.evict(0))
    assert set(blocks.held) == engine.held


def test_engine_hashes_are_used_when_reproduced_else_token_ids() -> None:
    ids = prompt(40, 0, 40)
    for seed, hashing in ((DEFAULT_SEED, "engine"), ("a random per-process seed", "tokens")):
        engine, blocks = ModelEngine(seed), EngineBlocks(FORMAT)
        connected(blocks, engine)
        deliver(blocks, engine, engine.store(ids))
        deliver(blocks, engine, engine.store(prompt(20, 1, 40)))
        deliver(blocks, engine, engine.evict(3))  # the 4th block of the first prompt
        assert blocks.hashing == hashing
        assert cached(blocks, ids) == engine.truth(ids) == 12
        # The evicted block is shared: the second prompt's chain breaks there too.
        assert cached(blocks, prompt(20, 1, 40)) == engine.truth(prompt(20, 1, 40)) == 12


def test_token_matching_cannot_follow_a_chain_whose_parent_it_missed() -> None:
    engine, blocks = ModelEngine("secret"), EngineBlocks(FORMAT)
    connected(blocks, engine)
    deliver(blocks, engine, engine.store(prompt(40, 0, 16)))
    seq, events = engine.store(prompt(40, 0, 40))  # its parent is block 4 of the first
    blocks.lost(seq)  # as if the first store had been lost
    blocks.receive(seq, events)
    assert cached(blocks, prompt(40, 0, 40)) == 0  # under-reports; never guesses


def test_salted_blocks_match_no_unsalted_request() -> None:
    engine, blocks = ModelEngine("secret"), EngineBlocks(FORMAT)
    connected(blocks, engine)
    seq, (event,) = engine.store(prompt(40, 0, 16))
    assert isinstance(event, BlocksStored)
    salted = dataclasses.replace(event, extra=(("salt",),) * 4)
    blocks.receive(seq, [salted])
    assert len(blocks) == 4 and cached(blocks, prompt(40, 0, 16)) == 0


def test_a_fresh_engine_replays_nothing_and_is_complete() -> None:
    blocks = EngineBlocks(FORMAT)
    connected(blocks, ModelEngine())
    assert blocks.synced and blocks.complete and len(blocks) == 0
    assert blocks.describe()["next_seq"] == 0


def test_joining_late_replays_from_the_engines_first_batch() -> None:
    engine = ModelEngine()
    for cut in (40, 8):
        engine.store(prompt(cut, 0, 48))
    engine.evict(1)
    blocks = EngineBlocks(FORMAT)
    connected(blocks, engine)
    assert blocks.complete and set(blocks.held) == engine.held
    # With a buffer that no longer starts at 0, the record is only what it holds.
    late = EngineBlocks(FORMAT)
    late.reset()
    start = late.begin_replay(0)
    for batch in engine.replay(start, keep=1):
        if not late.replayed(*batch):
            late.lost(batch[0])
            late.replayed(*batch)
    late.replay_done()
    assert late.synced and not late.complete and late.lost_gaps == 1
    assert set(late.held) <= engine.held
