"""The one small typed picture of an engine that every adapter produces."""

from __future__ import annotations

from dataclasses import dataclass


class MetricsParseError(ValueError):
    """The metrics text could not be read as the engine's Prometheus exposition."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What an engine said about itself in one scrape.

    Counts are summed over data-parallel engines. `kv_blocks_total` is 0 when the
    engine does not publish its cache size; consumers then fall back to requests.
    """

    running: int
    waiting: int
    kv_usage: float  # fraction of KV blocks in use, 0..1
    kv_blocks_total: int
    block_size: int  # tokens per KV block
    preemptions_total: int
    engines: int = 1  # data-parallel engine cores behind the server, each with its own queue

    @property
    def kv_blocks_used(self) -> float:
        return self.kv_usage * self.kv_blocks_total
