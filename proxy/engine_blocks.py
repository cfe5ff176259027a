"""What one engine's prefix cache holds, followed from its KV events: the precise
half of the prefix index (proxy/prefix_index.py).

The subscriber (proxy/kv_events.py) feeds each published batch in with its
sequence number; this module keeps the set of block hashes the engine holds and
says when the stream of batches cannot be trusted as it comes:

- **In order** (seq = the next expected): applied.
- **A gap** (seq past the next expected): nothing is applied; `receive` returns
  the seq to replay from. The subscriber asks the engine's replay endpoint and
  feeds the batches back in; a gap the replay cannot fill (the engine's buffer
  moved on, or there is no replay endpoint) is `lost`: the set is cleared and
  rebuilt from the batches that follow, which under-reports until the engine
  stores again (never an eviction missed and a dropped block claimed).
- **Going back** (seq below the next expected, outside a replay's overlap): the
  engine restarted, its counter and its cache started again from zero.
- A (re)connection clears everything; the subscriber then replays from 0.

Looking a request up (`cached_tokens`) hashes its token ids into blocks the
way the engine does, when that reproduces the engine's hashes (checked on the
first block of a sequence the engine stores), and walks the chain while the
engine holds each block. Where it does not (another hash algorithm, a random
seed), it matches on token ids instead: every stored block also gets Ferry's
own chained key over its tokens (`token_block_hashes`), computed from its
parent's key, so a chain whose parent was missed is not matched.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from adapters.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    EngineHash,
    KVEvent,
    KVEventsFormat,
)

TOKEN_ROOT = 0x5EED  # the parent of every chain's first block, in Ferry's keys
_UNKNOWN = -1  # a block whose tokens' chain Ferry could not follow (its parent was missed)


def token_block_key(parent: int, block: tuple[int, ...]) -> int:
    """Ferry's key for a full block after `parent`'s: chained like vLLM's hashes,
    but with Python's `hash` (stable for ints across processes, 64 bits, and it
    only has to match itself)."""
    return hash((parent, block))


def iter_token_block_hashes(token_ids: Sequence[int], block_size: int) -> Iterator[int]:
    """Ferry's chained keys of the full blocks of `token_ids`, one at a time."""
    prev = TOKEN_ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = token_block_key(prev, tuple(token_ids[start : start + block_size]))
        yield prev


def token_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Ferry's chained keys of the full blocks of `token_ids`."""
    return list(iter_token_block_hashes(token_ids, block_size))


class LazyChain:
    """A sequence's block hashes, computed only as far as a lookup walks: a
    prompt that misses at its first block costs one hash, not one per block
    (vLLM's sha256 measured 7.6 µs a block here: 16 ms of event loop for a
    32k-token prompt in blocks of 16 that is cached whole, 5 µs when its first
    block misses). Shared by the instances of one lookup that hash alike."""

    def __init__(self, hashes: Iterator[int]) -> None:
        self._source = hashes
        self._done: list[int] = []

    def run(self, held: dict[int, int] | Counter[int]) -> int:
        """How many leading hashes are held (a chain: the prefix up to the first miss)."""
        n = 0
        for h in itertools.chain(self._done, self._more()):
            if h not in held:
                break
            n += 1
        return n

    def _more(self) -> Iterator[int]:
        for h in self._source:
            self._done.append(h)
            yield h


@dataclass(slots=True)
class EngineBlocks:
    """One engine's cached blocks. `synced`: a subscriber is connected and has
    caught up; `heard`: the engine has spoken vLLM's KV events since (a batch
    decoded, or its replay answered), so that a publisher of something else is
    never taken for one that has nothing cached; `precise`: both. `complete`:
    every batch since the engine's cache was empty was applied (the set is the
    engine's, not a subset)."""

    format: KVEventsFormat
    held: dict[EngineHash, int] = field(default_factory=dict)  # engine hash -> Ferry's key
    keys: Counter[int] = field(default_factory=Counter)  # Ferry's keys of the held blocks
    block_size: int = 0  # from the events; 0 until the first store
    seed: str | None = None  # the seed that reproduces the engine's hashes, once checked
    hashing: str = "unknown"  # unknown | engine (reproduced) | tokens (Ferry's keys)
    next_seq: int | None = None  # None: nothing received since the last reset
    reached: int = 0  # the furthest next_seq of this engine process (kept across resets)
    replay_floor: int | None = None  # seqs in [floor, next_seq) are a replay's overlap
    synced: bool = False
    heard: bool = False
    complete: bool = False
    gaps: int = 0
    lost_gaps: int = 0
    restarts: int = 0
    clears: int = 0  # the engine dropped its whole cache (a clear, a restart)
    # Its LoRA adapters' names, as its stores say: their blocks' hashes cover the
    # adapter, which Ferry's do not (see `cached_tokens`).
    adapters: set[str] = field(default_factory=set)

    # -- the stream ----------------------------------------------------------------
    def reset(self) -> None:
        """Connected again (or for the first time): start over. The replay from
        0 that follows learns the block size and hashing again: the engine may
        be a new process, hashing as the old one did not."""
        self._clear()
        self.block_size, self.hashing, self.seed = 0, "unknown", None
        self.next_seq = self.replay_floor = None
        self.synced = self.heard = self.complete = False

    @property
    def precise(self) -> bool:
        """Whether what it holds is the engine's own account (the index reads it)."""
        return self.synced and self.heard

    def receive(self, seq: int, events: Sequence[KVEvent]) -> int | None:
        """One live batch; returns the seq to replay from when it opens a gap
        (nothing is applied then: replay, or call `lost`, then receive it again)."""
        expected = self.next_seq
        if expected is None:  # the first since a reset: nothing before it is known
            if seq < self.reached:  # below what it reached: a new process (no replay said so)
                self._restarted()
            if seq != 0:
                self.gaps += 1
                return self.begin_replay(0)
        elif seq > expected:
            self.gaps += 1
            return expected
        elif seq < expected:
            if self.replay_floor is not None and seq >= self.replay_floor:
                return None  # already applied from the replay
            self._restarted()
            if seq != 0:
                self.gaps += 1
                return self.begin_replay(0)
        self._apply(seq, events)
        self.replay_floor = None  # live again, past any replay's overlap
        return None

    def _restarted(self) -> None:
        """The counter went back: a new engine process, with an empty cache."""
        self.restarts += 1
        self.clears += 1
        self.reached = 0
        self._clear()
        self.block_size, self.hashing, self.seed = 0, "unknown", None
        self.next_seq = self.replay_floor = None
        self.complete = False

    def begin_replay(self, start: int) -> int:
        """The subscriber asks the engine to replay from `start` (and from 0 after a reset)."""
        if self.next_seq is None:
            self.next_seq = start
        return start

    def replayed(self, seq: int, events: Sequence[KVEvent]) -> bool:
        """A batch from the replay endpoint; False when it starts past the gap
        (the engine no longer buffers what was missed: call `lost(seq)`, then
        feed it again)."""
        expected = self.next_seq
        if expected is not None and seq < expected:
            return True  # already have it
        if expected is not None and seq > expected:
            return False
        if self.replay_floor is None:
            self.replay_floor = seq
        self._apply(seq, events)
        return True

    def replay_done(self) -> None:
        """The replay answered in full: caught up; later batches come live. An
        empty replay from 0 is an engine that never published: its cache is empty."""
        if self.next_seq == 0:
            self.complete = True
        self.synced = self.heard = True

    def restarted_while_away(self, reached_before: int) -> bool:
        """After a reconnection's replay: did the counter start again below what
        the engine had reached? Then it is a new process with an empty cache."""
        if self.next_seq is None or self.next_seq >= reached_before:
            return False
        self.restarts += 1
        self.clears += 1
        self.reached = self.next_seq
        return True

    def follow(self) -> None:
        """No replay to catch up from: follow what comes, incomplete."""
        self.synced = True

    def lost(self, resume_seq: int) -> None:
        """A gap no replay can fill: clear, and follow on from `resume_seq`,
        incomplete until the engine clears its cache."""
        self.lost_gaps += 1
        self._clear()
        self.next_seq, self.replay_floor = resume_seq, None
        self.synced, self.complete = True, False

    def _apply(self, seq: int, events: Sequence[KVEvent]) -> None:
        self.heard = True
        if seq == 0:
            self.complete = True  # the engine's first batch: its cache was empty before
        self.next_seq = seq + 1
        self.reached = max(self.reached, self.next_seq)
        for event in events:
            if isinstance(event, BlocksStored):
                self._store(event)
            elif isinstance(event, BlocksRemoved):
                self._remove(event.hashes)
            elif isinstance(event, AllCleared):
                self.clears += 1
                self._clear()
                self.complete = True  # empty now: everything from here is known

    def _store(self, event: BlocksStored) -> None:
        size, ids = event.block_size, event.token_ids
        if event.lora is not None:
            self.adapters.add(event.lora)
        if size < self.block_size:
            # Part of a block (vLLM stores a hybrid model's partial blocks so):
            # lookups hash whole blocks, and never reach it.
            return
        self.block_size = size
        if event.parent is None and self.hashing == "unknown" and event.extra is None:
            if event.hashes:  # an engine may publish a store of no blocks
                self._check_hashing(ids[:size], event.hashes[0])
        if event.parent is None:
            parent = TOKEN_ROOT
        else:
            parent = self.held.get(event.parent, _UNKNOWN)
        for i, h in enumerate(event.hashes):
            block = tuple(ids[i * size : (i + 1) * size])
            extra = event.extra[i] if event.extra and i < len(event.extra) else None
            if parent == _UNKNOWN or extra is not None:
                key = _UNKNOWN  # Ferry cannot name it by tokens alone
            else:
                key = token_block_key(parent, block)
            if h not in self.held:
                self.held[h] = key
                if key != _UNKNOWN:
                    self.keys[key] += 1
            parent = key

    def _remove(self, hashes: Iterable[EngineHash]) -> None:
        for h in hashes:
            key = self.held.pop(h, None)
            if key is not None and key != _UNKNOWN:
                self.keys[key] -= 1
                if self.keys[key] <= 0:
                    del self.keys[key]

    def _clear(self) -> None:
        self.held.clear()
        self.keys.clear()

    def _check_hashing(self, first_block: Sequence[int], published: EngineHash) -> None:
        """Which of the format's seeds reproduces the engine's hashes, if any."""
        for seed in self.format.seeds:
            if list(self.format.block_hashes(first_block, len(first_block), seed)) == [published]:
                self.hashing, self.seed = "engine", seed
                return
        self.hashing = "tokens"

    # -- lookups -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.held)

    def cached_tokens(self, token_ids: Sequence[int], memo: dict[object, LazyChain]) -> int:
        """Tokens of `token_ids` the engine would reuse from its cache: whole
        blocks it holds, within the first len - 1 tokens (vLLM always computes
        the last one). `memo` carries one request's block hashes across
        instances (they differ only by block size and seed)."""
        size = self.block_size
        if not size or not self.held:
            return 0
        usable = max(0, len(token_ids) - 1) // size  # blocks (islice: no copy of the ids)
        if self.hashing == "engine" and self.seed is not None:
            key: object = ("engine", size, self.seed)
            if key not in memo:
                hashes = self.format.block_hashes(token_ids, size, self.seed)
                memo[key] = LazyChain(itertools.islice(hashes, usable))
            found = memo[key].run(self.held)
        else:
            key = ("tokens", size)
            if key not in memo:
                hashes = iter_token_block_hashes(token_ids, size)
                memo[key] = LazyChain(itertools.islice(hashes, usable))
            found = memo[key].run(self.keys)
        return found * size

    def describe(self) -> dict[str, object]:
        return {
            "blocks": len(self.held),
            "block_size": self.block_size or None,
            "hashing": self.hashing,
            "synced": self.synced,
            "heard": self.heard,
            "complete": self.complete,
            "next_seq": self.next_seq,
            "gaps": self.gaps,
            "lost_gaps": self.lost_gaps,
            "restarts": self.restarts,
        }
