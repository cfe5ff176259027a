"""Frozen inputs of the policy core: what a decision may look at."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


def shown(text: str, limit: int = 256) -> str:
    """A client's string as a message or a log line shows it: its start, where it
    is long (a 32 MB model name made a 96 MB error and log line, on the loop)."""
    return text if len(text) <= limit else text[:limit] + "..."


class Priority(enum.IntEnum):
    """Request priority, from the `x-ferry-priority` header. Higher is more urgent."""

    LOW = 0
    NORMAL = 1
    HIGH = 2

    @classmethod
    def parse(cls, text: str) -> Priority:
        word = text.strip()
        try:
            if not word.isascii():  # ("hıgh".upper() is "HIGH")
                raise KeyError(word)
            return cls[word.upper()]
        except KeyError:
            got = shown(text, 100)  # (a header of 64 KiB)
            raise ValueError(f"priority must be one of high, normal, low (got {got!r})") from None


_NOTHING_CACHED: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class DispatchRequest:
    """The request being placed. `prompt_tokens` is an estimate before dispatch.

    `cached_tokens` maps an instance name to how many of the prompt's tokens are
    probably in its prefix cache (absent: none), from the prefix index
    (proxy/prefix_index.py); `affinity` names the instance that served the
    request's session last. Both are inputs: the policy reads, never fills, them.
    """

    model: str | None  # None: any instance (a pass-through call that names no model)
    prompt_tokens: int = 0
    priority: Priority = Priority.NORMAL
    exclude: frozenset[str] = frozenset()  # instances already tried for this request
    cached_tokens: Mapping[str, int] = field(default_factory=lambda: _NOTHING_CACHED)
    affinity: str | None = None
    # Where no other instance can take it, an ejected one may (Envoy's panic):
    # a new request, a broken stream's failover; not a move made by choice.
    panic: bool = False


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One instance as the scheduler sees it at one decision.

    `freeness` is Llumnix's F = (M - sum of virtual usage) / B in KV blocks per
    request, computed by `virtual_usage.instance_freeness` when the view is built
    (so a dispatch over N instances is one pass of comparisons). Fields read from
    the engine's last scrape are `engine_*` and `kv_usage`.
    """

    name: str
    freeness: float
    freeness_high: float = math.nan  # as a high-priority request sees it; NaN: same as freeness
    inflight: int = 0  # requests this proxy has in flight on the instance
    capacity_blocks: int = 0  # M; 0 when the engine does not say
    virtual_blocks: float = 0.0
    batch: int = 0  # B: ledger requests plus ones that bypassed the proxy
    kv_usage: float = 0.0  # scraped, 0..1
    engine_running: int = 0
    engine_waiting: int = 0
    # Of those, the ones beyond the requests the ledgers have waiting for a first
    # token (movable or not, this process's and its peers'): most likely streams
    # the engine preempted.
    engine_preempted: int = 0
    # Tokens of the requests here still waiting for their first token (ledger): the
    # prefill ahead of the engine. A lite move's continuation counts its P + G here.
    queued_tokens: int = 0
    block_size: int = 16  # tokens per KV block (the engine's; 16 until scraped)
    healthy: bool = True
    draining: bool = False
    models: frozenset[str] = frozenset()
    # Answering its scrapes, but ejected for failing calls (`healthy` is then
    # False): a request with nowhere else to go still goes there (`dispatch`).
    ejected: bool = False
    dispatchable: bool = field(init=False)  # healthy and not draining; one load per decision

    def __post_init__(self) -> None:
        object.__setattr__(self, "dispatchable", self.healthy and not self.draining)
        if math.isnan(self.freeness_high):
            object.__setattr__(self, "freeness_high", self.freeness)


@dataclass(frozen=True, slots=True)
class ClusterView:
    """All instances at one decision, plus the count of decisions made so far
    (round-robin's cursor, kept outside the policy so the policy stays pure)."""

    instances: tuple[InstanceView, ...]
    dispatch_seq: int = 0
