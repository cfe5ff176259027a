"""The shim's engine-core half, driven directly with small fakes of vLLM's request,
block pool and KV cache manager (vLLM itself is imported only for its base types)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest

with warnings.catch_warnings():  # vLLM's imports warn about torch deprecations
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm")
    from migration_shim import scheduler_side, wire
    from migration_shim.orders import WorkerProgress
    from migration_shim.scheduler_side import MigrationScheduler, Outgoing

BLOCK = 128


@dataclass
class FakeRequest:
    request_id: str
    num_tokens: int
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class FakePool:
    num_gpu_blocks: int = 16
    taken: list[object] = field(default_factory=list)

    def get_num_free_blocks(self) -> int:
        return self.num_gpu_blocks - len(self.taken)

    def get_new_blocks(self, n: int) -> list[object]:
        blocks = [object() for _ in range(n)]
        self.taken += blocks
        return blocks

    def free_blocks(self, blocks: list[object]) -> None:
        for block in blocks:
            self.taken.remove(block)


class FakeKV:
    def __init__(self) -> None:
        self.block_pool = FakePool()


class FakeBlocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


class FakeEngine:
    scheduler = None


def scheduler() -> MigrationScheduler:
    sched = MigrationScheduler(BLOCK)
    sched.kv = FakeKV()
    return sched


def continuation(mig_id: str, tokens: int, prompt_len: int) -> FakeRequest:
    params = {wire.LOAD: {"mig_id": mig_id, "num_tokens": tokens}}
    return FakeRequest("dest-req", prompt_len, params)


def test_a_continuation_waits_for_its_blocks_then_loads_all_but_one_token() -> None:
    sched = scheduler()
    request = continuation("m", tokens=300, prompt_len=301)
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)  # ask again
    sched.update_connector_output(_progress(staged={"m": 2}))  # 256 tokens: not enough
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
    sched.update_connector_output(_progress(staged={"m": 3}))
    assert sched.get_num_new_matched_tokens(request, 128) == (300 - 128, False)
    sched.update_state_after_alloc(request, FakeBlocks([7, 8, 9]), 300 - 128)
    (load,) = sched.build_connector_meta(_output()).loads
    assert load.mig_id == "m" and load.blocks == [(1, 8), (2, 9)]  # the local hit keeps block 0


@pytest.mark.parametrize(
    "params",
    [
        {wire.LOAD: 1},
        {wire.LOAD: {}},
        {wire.LOAD: {"mig_id": "m", "num_tokens": "many"}},
        {wire.LOAD: {"mig_id": ["m"], "num_tokens": 3}},
        {wire.LOAD: {"mig_id": "m", "num_tokens": -5}},
        {wire.TAG: {"not": "hashable as a tag"}, wire.LOAD: [1]},
        "not an object",
    ],
    ids=repr,
)
def test_a_load_in_another_shape_than_ferrys_is_no_load(params: Any) -> None:
    """A client's own kv_transfer_params reach the engine, and these hooks run in
    its step, where an exception ends the engine (TypeError, KeyError before)."""
    sched = scheduler()
    request = FakeRequest("client-req", 10, params)
    sched.on_new_request(request)  # type: ignore[arg-type]
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # type: ignore[arg-type]
    assert sched.request_finished(request, []) == (False, None)  # type: ignore[arg-type]


def test_a_continuation_whose_blocks_never_land_computes_them(monkeypatch: Any) -> None:
    sched = scheduler()
    request = continuation("m", tokens=300, prompt_len=301)
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
    monkeypatch.setattr(scheduler_side, "LOAD_WAIT_S", 0.0)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)


def test_a_reservation_holds_blocks_until_its_continuation_is_admitted() -> None:
    sched = scheduler()
    pool = sched.kv.block_pool
    assert not sched.command(FakeEngine(), "reserve", _reserve("m", 17))["ok"]
    assert sched.command(FakeEngine(), "reserve", _reserve("m", 4))["ok"]
    assert len(pool.taken) == 4
    sched.update_connector_output(_progress(staged={"m": 1}))
    assert sched.get_num_new_matched_tokens(continuation("m", 100, 101), 0) == (100, False)
    assert pool.taken == []  # returned to the pool just before vLLM allocates


def test_an_unclaimed_reservation_expires() -> None:
    sched = scheduler()
    sched.command(FakeEngine(), "reserve", _reserve("m", 4, lease_s=-1))
    orders = sched.build_connector_meta(_output())
    assert sched.kv.block_pool.taken == [] and orders.drops == ["m"]


def test_the_stopped_request_sends_the_rest_and_is_freed_later() -> None:
    sched = scheduler()
    sched.on_new_request(FakeRequest("src-req", 400, {wire.TAG: "t"}))
    sched.outgoing["m"] = Outgoing("src-req", "host:1", 0.0, scheduled=2, state="stopping")
    sched.mig_of_request["src-req"] = "m"
    delay, params = sched.request_finished(
        FakeRequest("src-req", 400, {wire.TAG: "t"}),
        [11, 12, 13, 14],
    )
    assert (delay, params) == (True, None)  # vLLM keeps the blocks until they are sent
    (copy,) = sched.build_connector_meta(_output()).copies
    assert copy.blocks == [(2, 13), (3, 14)] and copy.final_req_id == "src-req"
    assert copy.bandwidth == 0.0  # the rest goes unpaced: the request is stopped
    sched.command(FakeEngine(), "forget", {"mig_id": "m"})
    assert "m" in sched.outgoing  # still to be committed
    sched.update_connector_output(_progress(committed={"m"}))
    assert "m" not in sched.outgoing and "t" not in sched.by_tag


def test_a_request_that_ends_during_the_copy_ends_the_migration() -> None:
    sched = scheduler()
    sched.outgoing["m"] = Outgoing("src-req", "host:1", 0.0)
    sched.mig_of_request["src-req"] = "m"
    assert sched.request_finished(FakeRequest("src-req", 10), [1]) == (False, None)
    assert sched.outgoing["m"].state == "source_finished"


def _progress(**fields: Any) -> WorkerProgress:
    return WorkerProgress(**fields)


def _reserve(mig_id: str, blocks: int, lease_s: float = 30) -> dict[str, Any]:
    return {"mig_id": mig_id, "num_blocks": blocks, "lease_s": lease_s}


def _output() -> Any:
    class Output:
        preempted_req_ids: set[str] = set()

    return Output()


def test_a_continuation_preempted_after_its_load_is_recomputed_without_waiting() -> None:
    sched = scheduler()
    request = continuation("m", tokens=200, prompt_len=201)
    sched.update_connector_output(_progress(staged={"m": 2}))
    assert sched.get_num_new_matched_tokens(request, 0) == (200, False)
    sched.update_state_after_alloc(request, FakeBlocks([3, 4]), 200)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # after a preemption


def test_the_shim_refuses_more_than_one_worker_or_engine() -> None:
    """Data-parallel engines each bound the same KV port (the second failed at
    start) and the shim's calls reached all of them, answered by one."""
    from types import SimpleNamespace

    from migration_shim.connector import check_supported

    one = SimpleNamespace(world_size=1, data_parallel_size=1)
    check_supported(one, None)
    for world, data in ((2, 1), (1, 2)):
        with pytest.raises(ValueError, match="DP=1"):
            check_supported(SimpleNamespace(world_size=world, data_parallel_size=data), None)
    # Nor speculative decoding: a pre-copy would send KV of unverified tokens.
    with pytest.raises(ValueError, match="speculative"):
        check_supported(one, SimpleNamespace(method="eagle"))
