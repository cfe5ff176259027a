"""The KV connector vLLM loads by module path: `migration_shim.connector.FerryConnector`.

vLLM builds one in the engine-core process (scheduler role) and one in each
worker (worker role); this class only routes vLLM's hooks to the half that
does the work (`scheduler_side`, `worker_side`). Importing this module also
adds the `ferry_shim` utility to vLLM's EngineCore: the factory imports it in
the engine-core process, and the shim's HTTP routes reach the scheduler half
through `engine_core.call_utility_async("ferry_shim", ...)`, which vLLM runs
between engine steps.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.engine.core import EngineCore
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from migration_shim import wire
from migration_shim.orders import StepOrders
from migration_shim.scheduler_side import MigrationScheduler
from migration_shim.worker_side import MigrationWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

if vllm.__version__.split("+")[0] not in wire.SUPPORTED_VLLM:
    raise ImportError(
        f"migration_shim supports vLLM {', '.join(wire.SUPPORTED_VLLM)}, not {vllm.__version__}"
    )


class FerryConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    @property
    def requires_kv_delivery(self) -> bool:
        """vLLM's default for a producer (`kv_both`) recomputes the in-flight
        output of every preempted request, on every instance with the shim. The
        shim hands KV off only once its request has stopped, which no
        preemption can tear (the copies of a preempted one are dropped)."""
        return False

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_supported(vllm_config.parallel_config, vllm_config.speculative_config)
        block_size = vllm_config.cache_config.block_size
        self.scheduler: MigrationScheduler | None = None
        self.worker: MigrationWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = MigrationScheduler(block_size)
        else:
            config = self._kv_transfer_config
            settings = {"host": "127.0.0.1", **config.kv_connector_extra_config}
            settings["port"] = config.kv_port
            self.worker = MigrationWorker(
                _model_name(vllm_config), block_size, kv_cache_config.num_blocks, settings
            )

    # -- worker role ---------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_load_kv(self._orders())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous and whole before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # blocks are snapshotted once per step in wait_for_save

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.wait_for_save(self._orders())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self.worker is not None
        return self.worker.build_worker_meta()

    def _orders(self) -> StepOrders:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepOrders)
        return meta

    # -- scheduler role -------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self.scheduler is not None
        self.scheduler.kv = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output.kv_connector_worker_meta)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)


def check_supported(parallel: Any, speculative: Any) -> None:
    """One worker and one engine core per instance: `world_size` counts the
    workers of one engine (TP x PP), not data-parallel engines, each of which
    would bind the same KV port and answer the shim's calls for all of them.
    No speculative decoding: a request's computed tokens then count draft
    tokens not yet verified, and a pre-copy stage would send their KV."""
    if parallel.world_size != 1 or parallel.data_parallel_size != 1:
        raise ValueError("migration_shim supports one worker per instance (TP=PP=DP=1)")
    if speculative is not None:
        raise ValueError("migration_shim does not support speculative decoding")


def _model_name(vllm_config: VllmConfig) -> str:
    served = vllm_config.model_config.served_model_name
    return str(served[0] if isinstance(served, list) else served or vllm_config.model_config.model)


def ferry_shim(
    engine: EngineCore, command: str, args: dict[str, Any]
) -> dict[str, Any] | Future[dict[str, Any]]:
    """EngineCore utility: run one shim command on the scheduler half, between steps
    (vLLM answers a returned future when it completes)."""
    connector = engine.scheduler.get_kv_connector()
    if not isinstance(connector, FerryConnector) or connector.scheduler is None:
        return {"ok": False, "error": "this engine does not run the Ferry connector"}
    return connector.scheduler.command(engine, command, args)


EngineCore.ferry_shim = ferry_shim  # type: ignore[attr-defined]
