"""vLLM's KV cache events (`--kv-events-config`, the zmq publisher) and block hashes.

Read from vLLM 0.32 (vllm/distributed/kv_events.py, vllm/v1/core/kv_cache_utils.py):

- **Wire.** The publisher's PUB socket sends `(topic, seq, payload)`: `seq` is an
  8-byte big-endian counter that starts at 0 when the engine starts; `payload` is
  a msgpack `KVEventBatch`, the array `[ts, events, data_parallel_rank]`, each
  event a map tagged by `"type"`: `BlockStored` (block_hashes, parent_block_hash,
  token_ids, block_size, medium, extra_keys, ...), `BlockRemoved` (block_hashes,
  medium), `AllBlocksCleared`. A ROUTER on `replay_endpoint` answers a request
  `(b"", start_seq)` with every buffered `(b"", topic, seq, payload)` from
  `start_seq` on (the last `buffer_steps` batches, 10,000 by default), then
  `(b"", b"", END_SEQ, b"")`.
- **Hashes.** With the default `prefix_caching_hash_algo: sha256`, block i's hash
  is `sha256(pickle((parent, tuple(block_token_ids), extra_keys)))`, chained from
  `NONE_HASH = sha256(pickle(seed))`, where the seed is "vllm-none-hash" unless
  the engine's PYTHONHASHSEED sets it. Events carry the digest's low 64 bits as
  an int. Ferry reproduces that for a request's token ids, so it can look a
  prompt up in the engine's own hash set.
  Not reproducible from here: `sha256_cbor` (needs cbor2), `xxhash` (a random
  per-process seed unless PYTHONHASHSEED is set), an unknown PYTHONHASHSEED, and
  blocks with extra keys (LoRA, cache salt, multimodal). The index checks the
  hashes on the first block of a sequence before it trusts them, and otherwise
  matches on the token ids the BlockStored events carry (proxy/engine_blocks.py).
- **Medium.** The engine's own block pool publishes medium "GPU" (on the CPU
  build too); offloading connectors publish their tiers ("CPU", "STORAGE").
  Only the engine's pool is its prefix cache here, so other media are skipped.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

from adapters.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    EngineHash,
    KVEvent,
    KVEventsDecodeError,
    KVEventsFormat,
)

DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed without PYTHONHASHSEED
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message
_ENGINE_MEDIA = (None, "GPU")
_LOW_64 = (1 << 64) - 1
_decoder = msgspec.msgpack.Decoder()


def decode(payload: bytes) -> list[KVEvent]:
    """One published batch's events, in order (other media and unknown types skipped)."""
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventsDecodeError(f"not msgpack: {exc}") from exc
    if not (isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list)):
        raise KVEventsDecodeError("not a KVEventBatch [ts, events, ...]")
    out: list[KVEvent] = []
    for raw in batch[1]:
        if not isinstance(raw, dict):
            raise KVEventsDecodeError(f"an event is not a map: {raw!r:.80}")
        event = _event(raw)
        if event is not None:
            out.append(event)
    return out


def _event(raw: dict[str, Any]) -> KVEvent | None:
    kind = raw.get("type")
    if kind == "AllBlocksCleared":
        return AllCleared()
    if raw.get("medium") not in _ENGINE_MEDIA or kind not in ("BlockStored", "BlockRemoved"):
        return None
    if raw.get("group_idx") not in (None, 0):
        # A hybrid model's other KV cache groups publish blocks of their own,
        # under the same hashes: followed too, one group's removal would drop
        # another's block. The first group stands for the request's prefix.
        return None
    try:
        hashes = tuple(_hash(h) for h in raw["block_hashes"])
        if kind == "BlockRemoved":
            return BlocksRemoved(hashes)
        parent = raw.get("parent_block_hash")
        token_ids = tuple(raw["token_ids"])
        block_size = raw["block_size"]
        extra = raw.get("extra_keys")
        lora = raw.get("lora_name")
    except (KeyError, TypeError) as exc:
        raise KVEventsDecodeError(f"{kind}: missing or bad field: {exc}") from exc
    if not (isinstance(block_size, int) and block_size > 0):
        raise KVEventsDecodeError(f"BlockStored: bad block_size {block_size!r}")
    if not all(isinstance(t, int) for t in token_ids) or len(token_ids) < len(hashes) * block_size:
        raise KVEventsDecodeError("BlockStored: token_ids do not fill its blocks")
    if not (isinstance(extra, list) and any(e is not None for e in extra)):
        extra = None  # vLLM sends [None, None, ...] for plain blocks
    return BlocksStored(
        hashes,
        None if parent is None else _hash(parent),
        token_ids,
        block_size,
        None if extra is None else tuple(extra),
        lora if isinstance(lora, str) else None,
    )


def _hash(value: Any) -> EngineHash:
    """An engine hash as an int: an int as published, a digest folded as vLLM folds it."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _LOW_64
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _LOW_64
    raise KVEventsDecodeError(f"a block hash is neither int nor bytes: {value!r:.40}")


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


@functools.lru_cache(maxsize=8)
def _none_hash(seed: str) -> bytes:
    return _sha256(seed)


def block_hashes(token_ids: Sequence[int], block_size: int, seed: str) -> Iterator[EngineHash]:
    """vLLM's hashes (`sha256`, no extra keys) of the full blocks of `token_ids`,
    folded to the 64-bit ints its events carry, one block at a time (each hash
    chains on the whole digest before it)."""
    parent = _none_hash(seed)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _sha256((parent, tuple(token_ids[start : start + block_size]), None))
        yield int.from_bytes(parent, "big") & _LOW_64


FORMAT = KVEventsFormat(
    decode=decode, block_hashes=block_hashes, seeds=(DEFAULT_SEED,), replay_end=END_SEQ
)
