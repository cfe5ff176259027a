"""What the engine-core side of the connector tells the worker side each step, and back.

Both travel with vLLM's own step messages (`KVConnectorMetadata` down,
`KVConnectorWorkerMetadata` up), so no extra channel is needed inside one instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

# (the block's position in the request, its block id in this instance's KV cache)
BlockPlace = tuple[int, int]


@dataclass
class CopyOrder:
    """Source: snapshot these blocks after this step's forward and send them."""

    mig_id: str
    dest: str
    blocks: list[BlockPlace]
    bandwidth: float
    final_req_id: str | None = None  # set on the stop-and-copy: free the blocks when sent


@dataclass
class LoadOrder:
    """Destination: write these staged blocks into these block ids before the forward."""

    mig_id: str
    blocks: list[BlockPlace]


@dataclass
class StepOrders(KVConnectorMetadata):
    copies: list[CopyOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)  # migrations whose staged blocks to drop
    cancels: list[str] = field(default_factory=list)  # migrations whose queued sends to drop


@dataclass
class WorkerProgress(KVConnectorWorkerMetadata):
    # As a source:
    acked: dict[str, int] = field(default_factory=dict)  # mig_id -> blocks through so far
    errors: dict[str, str] = field(default_factory=dict)
    committed: set[str] = field(default_factory=set)  # stop-and-copy finished (or failed)
    # As a destination: mig_id -> blocks staged without a gap from the first one.
    staged: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.acked or self.errors or self.committed or self.staged)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, WorkerProgress)
        return WorkerProgress(
            {**self.acked, **other.acked},
            {**self.errors, **other.errors},
            self.committed | other.committed,
            {**self.staged, **other.staged},
        )
