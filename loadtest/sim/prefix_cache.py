"""The simulated engine's prefix cache, and the keys of a simulated request's blocks.

A request's prompt is, block by block (`block_size` tokens): its group's system
prompt (`prefix_tokens`), then its session's conversation, then, without a
session, its own tokens. A block's key names what it holds: (0, group, k) for
the k-th block of a system prompt, (1, session, k) for a session's, (2, id, k)
for a request's own. Blocks are only shared in that nesting (a session keeps one
group), so a key stands for the whole chain before it, as vLLM's chained hash does.

`EngineCache` is vLLM's prefix cache as the simulator models it: an LRU of block
keys, bounded by the engine's KV blocks. At admission a request's hit is its
leading prompt blocks found there (at most all but its last token: vLLM always
computes one); its prefill is the rest. Its prompt blocks go in at admission and
its generated full blocks when it finishes (a session's next turn starts with
them). Approximations, on purpose: blocks in use by running requests count
toward the bound and may be evicted (vLLM keeps them), and a hit saves compute
only: its blocks are still allocated per request (vLLM shares them).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from proxy.prefix_index import PrefixKey

Key = tuple[int, int, int]


class Prefixed(Protocol):
    id: int
    prefix_group: int
    prefix_tokens: int
    session: int


def block_keys(r: Prefixed, tokens: int, block_size: int) -> list[Key]:
    """Keys of the full blocks of the first `tokens` tokens of `r`'s sequence."""
    keys: list[Key] = []
    group_blocks = r.prefix_tokens // block_size if r.prefix_group >= 0 else 0
    for k in range(tokens // block_size):
        if k < group_blocks:
            keys.append((0, r.prefix_group, k))
        elif r.session >= 0:
            keys.append((1, r.session, k))
        else:
            keys.append((2, r.id, k))
    return keys


class EngineCache:
    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        self.capacity = capacity_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[Key, None] = OrderedDict()
        self.queried_tokens = 0  # vllm:prefix_cache_queries
        self.hit_tokens = 0  # vllm:prefix_cache_hits

    def __len__(self) -> int:
        return len(self._blocks)

    def admit(self, r: Prefixed, tokens: int) -> int:
        """`r` is admitted with `tokens` to compute (prompt, or prompt + generated
        after a preemption or a move): returns the tokens found cached."""
        keys = block_keys(r, tokens, self.block_size)
        blocks = self._blocks
        hit = 0
        for key in keys:
            if key not in blocks:
                break
            hit += 1
        cached = min(hit * self.block_size, tokens - 1) if tokens > 0 else 0
        self.queried_tokens += tokens
        self.hit_tokens += cached
        self.insert(keys)
        return cached

    def insert(self, keys: list[Key]) -> None:
        blocks = self._blocks
        for key in keys:
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


def index_key(r: Prefixed, prompt_tokens: int, block_size: int) -> PrefixKey:
    """What Ferry's prefix index keys a simulated request by at dispatch: its
    prompt's block keys, hashed (the simulator has no text; the proxy chunks the
    text into blocks of the same size), and its session."""
    chunks = tuple(hash(k) for k in block_keys(r, prompt_tokens, block_size))
    return PrefixKey(chunks, prompt_tokens, str(r.session) if r.session >= 0 else None)
