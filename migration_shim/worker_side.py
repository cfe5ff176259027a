"""The worker half of the shim: snapshot blocks to send, write staged blocks in.

It runs in the vLLM worker process that owns the KV cache tensors. Copies are
snapshotted in `wait_for_save`, after the step's forward, so a block is never
read while the model writes it; sending happens on the transport's thread.
Loads happen in `start_load_kv`, which vLLM runs before the forward of a step
with a synchronous load.

On CPU each layer's cache is one tensor `[num_blocks, kv_heads, block_size,
2 * head_size]` whose block contents are packed for the CPU's instruction set;
GPU backends put K and V first (`[2, num_blocks, ...]`). Either way a block is
moved whole, as bytes (through host memory on a GPU), and only between
instances whose layout (shapes, dtype, ISA) matches, which the transport checks
when it connects.
"""

from __future__ import annotations

import logging
import platform
from typing import Any

import torch

from migration_shim.orders import StepOrders, WorkerProgress
from migration_shim.transport import BlockCopy, BlockReceiver, BlockSender, Commit

log = logging.getLogger("ferry.shim")


class MigrationWorker:
    def __init__(
        self, model: str, block_size: int, num_blocks: int, settings: dict[str, Any]
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.settings = settings
        self.layers: list[torch.Tensor] = []
        self.block_dims: list[int] = []  # per layer: which dimension indexes blocks
        self.sender: BlockSender | None = None
        self.receiver: BlockReceiver | None = None
        self.load_errors: set[int] = set()
        # Stopped requests whose last blocks are on their way (their Commit is
        # queued), and those of them vLLM has listed finished: only these are
        # kept, not every request the instance ever finishes.
        self.awaiting: set[str] = set()
        self.seen_finished: set[str] = set()
        self.unreported: set[str] = set()  # sent, waiting for vLLM to list it finished
        self.progress = WorkerProgress()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        seen: set[int] = set()
        for tensor in kv_caches.values():  # layers that share a cache alias one tensor
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                self.layers.append(tensor)
                self.block_dims.append(_block_dim(tensor, self.num_blocks))
        layout = self.layout()
        self.sender = BlockSender(layout)
        self.receiver = BlockReceiver(
            self.settings["host"],
            int(self.settings["port"]),
            layout,
            lease_s=float(self.settings.get("lease_s", 60)),
            max_bytes=int(self.settings.get("staging_bytes", 1 << 30)),
        )
        log.info(
            "ferry shim: %d KV layers, receiving on %s", len(self.layers), self.receiver.address
        )

    def layout(self) -> dict[str, Any]:
        first = self.layers[0]
        isa = (
            f"{first.device.type}:{torch.cuda.get_device_name(first.device)}"
            if first.device.type == "cuda"
            else _attention_isa(first.dtype, self.block_size, first.shape[-1] // 2)
        )
        return {
            "model": self.model,
            "block_size": self.block_size,
            "dtype": str(first.dtype),
            "shapes": [list(self._block(i, 0).shape) for i in range(len(self.layers))],
            "isa": isa,
        }

    def _block(self, layer: int, block_id: int) -> torch.Tensor:
        return self.layers[layer].select(self.block_dims[layer], block_id)

    # -- source -------------------------------------------------------------------
    def wait_for_save(self, orders: StepOrders) -> None:
        assert self.sender is not None and self.receiver is not None
        for copy in orders.copies:
            for index, block_id in copy.blocks:
                payload = b"".join(
                    _to_bytes(self._block(i, block_id)) for i in range(len(self.layers))
                )
                self.sender.submit(
                    BlockCopy(copy.mig_id, copy.dest, index, payload, copy.bandwidth)
                )
            if copy.final_req_id is not None:
                self.awaiting.add(copy.final_req_id)
                self.sender.submit(Commit(copy.mig_id, copy.final_req_id))
        for mig_id in orders.drops:
            self.receiver.drop(mig_id)
        for mig_id in orders.cancels:
            self.sender.cancel(mig_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        """Requests whose stop-and-copy is through: vLLM may free their blocks now."""
        assert self.sender is not None
        # vLLM lists a stopped request finished in the step that carries its
        # final copy, and `wait_for_save` (which queues its Commit) runs first.
        self.seen_finished |= finished_req_ids & self.awaiting
        sent = self.sender.take_progress()
        self.progress.acked.update(sent.acked)
        self.progress.errors.update(sent.errors)
        self.progress.committed |= sent.committed
        self.unreported |= sent.finished_sending
        # vLLM only accepts ids it has already passed in as finished.
        ready = self.unreported & self.seen_finished
        self.unreported -= ready
        self.seen_finished -= ready
        self.awaiting -= ready
        return (ready or None), None

    def build_worker_meta(self) -> WorkerProgress | None:
        assert self.receiver is not None
        progress, self.progress = self.progress, WorkerProgress()
        progress.staged = self.receiver.take_arrivals()
        return progress or None

    # -- destination --------------------------------------------------------------------
    def start_load_kv(self, orders: StepOrders) -> None:
        assert self.receiver is not None
        for load in orders.loads:
            staged = self.receiver.take(load.mig_id)
            for index, block_id in load.blocks:
                payload = staged.get(index)
                if payload is None or not self._write_block(block_id, payload):
                    # vLLM recomputes these blocks (kv_load_failure_policy "recompute").
                    log.warning("migration %s: block %d missing, recomputed", load.mig_id, index)
                    self.load_errors.add(block_id)

    def _write_block(self, block_id: int, payload: bytearray) -> bool:
        blocks = [self._block(i, block_id) for i in range(len(self.layers))]
        sizes = [b.numel() * b.element_size() for b in blocks]
        if len(payload) != sum(sizes):
            return False
        start = 0
        for block, size in zip(blocks, sizes, strict=True):
            raw = torch.frombuffer(payload, dtype=torch.uint8, count=size, offset=start)
            block.copy_(raw.view(block.dtype).view(block.shape), non_blocking=False)
            start += size
        return True

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors


def _block_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    for dim in (0, 1):  # CPU and most backends: blocks first; flash-attn: K/V first
        if tensor.shape[dim] == num_blocks:
            return dim
    raise ValueError(f"no block dimension of size {num_blocks} in KV shape {tuple(tensor.shape)}")


def _to_bytes(block: torch.Tensor) -> bytes:
    """A block's bytes in host memory, whatever its dtype (numpy has no bfloat16)."""
    raw = block.contiguous().view(torch.uint8)
    return bytes(raw.cpu().numpy().tobytes())


def _attention_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The CPU attention kernel's packing of a block: blocks only move between equals."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return f"{platform.machine()}/{_get_attn_isa(dtype, block_size, head_size)}"
    except (ImportError, AttributeError, RuntimeError, NotImplementedError):
        return platform.machine()
