"""vLLM's KV event wire format and block hashes (adapters/vllm_kv_events.py).

The payloads are msgpack as vLLM 0.32's `KVEventBatch` encodes it (an array
`[ts, events, dp_rank]`, events as maps tagged by "type"; seen on a real server),
built here without importing vLLM. The hash figures were read off a real
server's BlockStored event for the prompt ids 5..304 (block size 128).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from adapters import get_adapter
from adapters.kv_events import AllCleared, BlocksRemoved, BlocksStored, KVEventsDecodeError
from adapters.vllm_kv_events import DEFAULT_SEED, decode
from adapters.vllm_kv_events import block_hashes as lazy_block_hashes


def block_hashes(ids: list[int], size: int, seed: str) -> list[int]:
    return list(lazy_block_hashes(ids, size, seed))


def payload(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([1796084222.5, list(events), 0])


def stored(
    hashes: list[Any], parent: Any, ids: list[int], size: int, **more: Any
) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": ids,
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        **more,
    }


def test_the_hashes_are_the_ones_a_real_server_published() -> None:
    assert block_hashes(list(range(5, 305)), 128, DEFAULT_SEED) == [
        15409373647757131110,
        9105260760118760290,
    ]
    # A different seed (PYTHONHASHSEED on the engine) gives other hashes.
    assert block_hashes(list(range(5, 305)), 128, "42")[0] != 15409373647757131110


def test_hashes_chain_over_full_blocks_only() -> None:
    ids = list(range(300))
    assert len(block_hashes(ids, 128, DEFAULT_SEED)) == 2
    assert block_hashes(ids[:256], 128, DEFAULT_SEED) == block_hashes(ids, 128, DEFAULT_SEED)
    other = [999, *ids[1:]]  # the first block differs: so does every later hash
    assert block_hashes(other, 128, DEFAULT_SEED)[1] != block_hashes(ids, 128, DEFAULT_SEED)[1]


def test_decode_reads_each_kind_in_order() -> None:
    digest = bytes(range(32))
    events = decode(
        payload(
            stored([7, 8], None, list(range(4)), 2),
            {"type": "BlockRemoved", "block_hashes": [7, digest], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        )
    )
    assert events == [
        BlocksStored((7, 8), None, (0, 1, 2, 3), 2),
        # A digest (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) folds as vLLM folds it.
        BlocksRemoved((7, int.from_bytes(digest, "big") & (2**64 - 1))),
        AllCleared(),
    ]


def test_offloaded_tiers_and_unknown_events_are_skipped() -> None:
    events = decode(
        payload(
            stored([1], None, [1, 2], 2, medium="CPU"),
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "STORAGE"},
            {"type": "SomethingNew", "x": 1},
            stored([2], None, [1, 2], 2, medium=None),
        )
    )
    assert events == [BlocksStored((2,), None, (1, 2), 2)]


def test_only_the_first_kv_cache_groups_blocks_are_followed_and_adapters_named() -> None:
    """A hybrid model publishes each KV cache group's blocks under the same
    hashes: another group's removal would drop a block the first still holds."""
    events = decode(
        payload(
            stored([1], None, [1, 2], 2, group_idx=1),
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 1},
            stored([2], None, [1, 2], 2, lora_name="sql-lora", extra_keys=[["sql-lora"]]),
            {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU", "group_idx": 0},
        )
    )
    assert events == [
        BlocksStored((2,), None, (1, 2), 2, (["sql-lora"],), "sql-lora"),
        BlocksRemoved((2,)),
    ]


def test_extra_keys_are_kept_only_when_some_block_has_them() -> None:
    (plain,) = decode(payload(stored([1], None, [1, 2], 2)))
    assert isinstance(plain, BlocksStored) and plain.extra is None
    (salted,) = decode(payload(stored([1], None, [1, 2], 2, extra_keys=[["salt"]])))
    assert isinstance(salted, BlocksStored) and salted.extra == (["salt"],)


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode([1.0, [5]]),
        payload({"type": "BlockStored", "block_hashes": [1], "medium": "GPU"}),
        payload(stored([1, 2], None, [1, 2, 3], 2)),  # too few token ids for two blocks
        payload(stored([1], None, [1, 2], 0)),
        payload(stored(["h"], None, [1, 2], 2)),
    ],
)
def test_bad_payloads_raise_the_decode_error(raw: bytes) -> None:
    with pytest.raises(KVEventsDecodeError):
        decode(raw)


def test_the_vllm_adapter_names_its_format() -> None:
    fmt = get_adapter("vllm").kv_events
    assert fmt is not None and fmt.decode is decode and fmt.seeds == (DEFAULT_SEED,)
    assert get_adapter("openai").kv_events is None
