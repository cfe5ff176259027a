"""KV cache events: what an engine says its prefix cache stored and dropped.

Engine-neutral types, plus `KVEventsFormat`, the part of an adapter that knows
one engine's wire format and block hashing. The proxy's subscriber
(proxy/kv_events.py) hands each message's payload to `decode`, and the precise
prefix index (proxy/engine_blocks.py) reads the events. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

# An engine's own name for a block, as an int. vLLM publishes the low 64 bits
# of its sha256 block hash by default, and the whole digest as bytes with
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; decoders fold digests to the same low
# 64 bits, so one engine's hashes compare equal whichever way it publishes.
EngineHash = int


class KVEventsDecodeError(ValueError):
    """A payload that is not a batch of KV events in the engine's format."""


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Full blocks now cached: `hashes[i]` holds `token_ids[i*block_size:(i+1)*block_size]`,
    chained on `parent` (None: the first block of a sequence). `extra[i]` is not
    None where the block's hash also covers more than its tokens (a LoRA
    adapter, a cache salt, multimodal input); `lora` names the adapter."""

    hashes: tuple[EngineHash, ...]
    parent: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    extra: tuple[object, ...] | None = None
    lora: str | None = None  # the LoRA adapter the blocks were computed with


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    hashes: tuple[EngineHash, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The engine dropped its whole prefix cache (vLLM: `reset_prefix_cache`)."""


KVEvent = BlocksStored | BlocksRemoved | AllCleared


@dataclass(frozen=True, slots=True)
class KVEventsFormat:
    """How one engine publishes KV events and names its blocks.

    - `decode(payload)`: one published message's events, in order; raises
      `KVEventsDecodeError`.
    - `block_hashes(token_ids, block_size, seed)`: the engine's own hashes of the
      full blocks of a token sequence, as `decode` gives them, for a hash seed the
      engine may be using, lazily (a lookup stops at the first block the engine
      lacks); a prefix cached on the engine is a run of these.
    - `seeds`: the seeds to try, in order (`block_hashes` is checked against the
      first stored block of a sequence before it is trusted).
    - `replay_end`: the seq frame that ends a replay's answer.
    """

    decode: Callable[[bytes], list[KVEvent]]
    block_hashes: Callable[[Sequence[int], int, str], Iterator[EngineHash]]
    seeds: tuple[str, ...]
    replay_end: bytes
