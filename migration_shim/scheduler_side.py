"""The engine-core half of the shim: which blocks move when, reservations, loads.

Everything here runs on vLLM's engine thread: the connector hooks during a
step, and the control commands between steps (EngineCore utility calls), so no
locks are needed and scheduler state can be read and changed safely.

A migration out of this instance (`Outgoing`) goes:
  copying --stage()--> copying ... --stop()--> stopped --last block through--> done
with `failed` (before the stop: the request runs on here), `source_finished` (it
ended here meanwhile) and `failed_after_stop` (the last blocks did not all go
out) as the other ends. A migration into this instance is a reservation of
blocks, then a request tagged `LOAD`, held until its blocks have landed in
staging (or for at most LOAD_WAIT_S, after which it computes them itself), whose
first tokens the connector reports as externally computed and has the worker
fill from staging.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from migration_shim import wire
from migration_shim.orders import CopyOrder, LoadOrder, StepOrders, WorkerProgress

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

log = logging.getLogger("ferry.shim")

# A continuation waits this long for its blocks to land, then computes them itself.
LOAD_WAIT_S = 5.0
MAX_STAGED_RECORDS = 1024


@dataclass
class Outgoing:
    req_id: str
    dest: str
    bandwidth: float
    scheduled: int = 0  # blocks [0, scheduled) are ordered copied
    acked: int = 0
    stages: int = 0
    state: str = "copying"
    error: str | None = None
    forgotten: bool = False  # the control route is done with it; drop it once settled

    def report(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "scheduled": self.scheduled,
            "acked": self.acked,
            "stages": self.stages,
            "error": self.error,
        }


@dataclass
class Incoming:
    mig_id: str
    num_tokens: int  # tokens whose KV is loaded from staging
    local: int  # tokens the local prefix cache already had
    loaded: bool = False  # staging is used once; after a preemption vLLM recomputes


@dataclass
class Reservation:
    blocks: list[Any]  # vLLM KVCacheBlock objects taken from the pool
    expires: float


class MigrationScheduler:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.kv: KVCacheManager | None = None
        self.by_tag: dict[str, str] = {}  # Ferry's tag -> engine request id
        self.outgoing: dict[str, Outgoing] = {}
        self.mig_of_request: dict[str, str] = {}
        self.incoming: dict[str, Incoming] = {}  # engine request id -> its load
        # Destination: blocks staged per migration (as the worker reports them), and
        # since when each continuation has waited for its blocks.
        self.staged: OrderedDict[str, int] = OrderedDict()
        self.load_waits: dict[str, float] = {}
        self.reserved: dict[str, Reservation] = {}
        self.orders = StepOrders()
        # `wait` commands not yet answered: vLLM replies when the future completes.
        self.waiters: list[tuple[str, Future[dict[str, Any]]]] = []

    # -- connector hooks (engine thread, during a step) ---------------------------
    def on_new_request(self, request: Request) -> None:
        tag = _params(request).get(wire.TAG)
        if tag:
            self.by_tag[str(tag)] = request.request_id

    def get_num_new_matched_tokens(self, request: Request, local: int) -> tuple[int | None, bool]:
        load = _load(request)
        if load is None:
            return 0, False
        (mig_id, num_tokens), req_id = load, request.request_id
        if (incoming := self.incoming.get(req_id)) is not None and incoming.loaded:
            return 0, False
        # At least one token must be computed here: it yields the next token.
        tokens = min(num_tokens, request.num_tokens - 1)
        landed = self.staged.get(mig_id, 0) * self.block_size >= tokens
        if not landed and tokens > local:
            # Ferry starts the continuation while the source sends its last blocks:
            # hold it (vLLM asks again next step) until they are here.
            waited = time.monotonic() - self.load_waits.setdefault(req_id, time.monotonic())
            if waited < LOAD_WAIT_S:
                return None, False
            log.warning("migration %s: blocks did not arrive, recomputing", mig_id)
        self.load_waits.pop(req_id, None)
        # The reserved blocks go back to the pool right before vLLM allocates this
        # request's blocks in the same pass, so they are the ones it gets.
        self._free_reservation(mig_id)
        if not landed or tokens <= local:
            return 0, False
        self.incoming[req_id] = Incoming(mig_id, tokens, local)
        return tokens - local, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        incoming = self.incoming.get(request.request_id)
        if incoming is None or num_external_tokens == 0:
            return
        # Positions, not just the unhashed blocks: a local prefix hit keeps its own.
        ids = blocks.get_block_ids()[0]
        first = incoming.local // self.block_size
        last = -(-incoming.num_tokens // self.block_size)
        self.orders.loads.append(
            LoadOrder(incoming.mig_id, [(i, ids[i]) for i in range(first, last)])
        )
        incoming.loaded = True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepOrders:
        self._expire_reservations()
        preempted = scheduler_output.preempted_req_ids or set()
        orders, self.orders = self.orders, StepOrders()
        kept = []
        for copy in orders.copies:
            out = self.outgoing.get(copy.mig_id)
            if copy.final_req_id is None and (out is None or out.req_id in preempted):
                # Preempted blocks may be reused by this very step: copy them later.
                if out is not None and copy.blocks:
                    out.scheduled = min(out.scheduled, copy.blocks[0][0])
                continue
            kept.append(copy)
        orders.copies = kept
        return orders

    def update_connector_output(self, progress: Any) -> None:
        if isinstance(progress, WorkerProgress):
            self._apply(progress)
        self._answer_waiters()

    def _apply(self, progress: WorkerProgress) -> None:
        for mig_id, acked in progress.acked.items():
            if (out := self.outgoing.get(mig_id)) is not None:
                out.acked = acked
        for mig_id, error in progress.errors.items():
            if (out := self.outgoing.get(mig_id)) is not None:
                out.error = error
                if out.state == "copying":
                    out.state = "failed"
        for mig_id in progress.committed:
            if (out := self.outgoing.get(mig_id)) is not None and out.state == "stopped":
                out.state = "failed_after_stop" if out.error else "done"
                if out.forgotten:
                    del self.outgoing[mig_id]
        self.staged.update(progress.staged)
        while len(self.staged) > MAX_STAGED_RECORDS:  # loads that never came
            self.staged.popitem(last=False)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        req_id = request.request_id
        tag = _params(request).get(wire.TAG)
        if tag and self.by_tag.get(str(tag)) == req_id:
            del self.by_tag[str(tag)]
        if (incoming := self.incoming.pop(req_id, None)) is not None:
            self.staged.pop(incoming.mig_id, None)
        self.load_waits.pop(req_id, None)
        mig_id = self.mig_of_request.pop(req_id, None)
        out = self.outgoing.get(mig_id) if mig_id else None
        if out is None:
            return False, None
        if out.state != "stopping":
            out.state = "source_finished"
            self._answer_waiters()
            return False, None
        # Stop-and-copy: the rest, partial last block included. The blocks stay
        # pinned (delay_free) until the worker reports them sent.
        assert mig_id is not None
        rest = [(i, block_ids[i]) for i in range(out.scheduled, len(block_ids))]
        out.scheduled, out.state = len(block_ids), "stopped"
        # Unpaced: the request is stopped now, and the rest is at most a few blocks.
        self.orders.copies.append(CopyOrder(mig_id, out.dest, rest, 0.0, req_id))
        return True, None

    # -- control commands (engine thread, between steps) -----------------------------
    def command(
        self, engine: Any, name: str, args: dict[str, Any]
    ) -> dict[str, Any] | Future[dict[str, Any]]:
        self._expire_reservations()
        handler = getattr(self, "cmd_" + name, None)
        if handler is None:
            return {"ok": False, "error": f"unknown shim command {name!r}"}
        result: dict[str, Any] | Future[dict[str, Any]] = handler(engine.scheduler, engine, **args)
        return result

    def cmd_info(self, scheduler: Scheduler, engine: Any) -> dict[str, Any]:
        pool = self._pool()
        return {
            "ok": True,
            "num_blocks": pool.num_gpu_blocks,
            "free_blocks": pool.get_num_free_blocks(),
            "reserved_blocks": sum(len(r.blocks) for r in self.reserved.values()),
            "migrations_out": len(self.outgoing),
        }

    def cmd_reserve(
        self, scheduler: Scheduler, engine: Any, mig_id: str, num_blocks: int, lease_s: float
    ) -> dict[str, Any]:
        pool = self._pool()
        free = pool.get_num_free_blocks()
        if num_blocks > free:
            return {"ok": False, "error": f"needs {num_blocks} KV blocks, {free} are free"}
        self._free_reservation(mig_id)
        blocks = pool.get_new_blocks(num_blocks)
        self.reserved[mig_id] = Reservation(blocks, time.monotonic() + lease_s)
        return {"ok": True, "free_blocks": free - num_blocks}

    def cmd_release(self, scheduler: Scheduler, engine: Any, mig_id: str) -> dict[str, Any]:
        self._free_reservation(mig_id)
        self.orders.drops.append(mig_id)
        return {"ok": True}

    def cmd_begin(
        self,
        scheduler: Scheduler,
        engine: Any,
        mig_id: str,
        tag: str,
        dest: str,
        bandwidth: float,
    ) -> dict[str, Any]:
        from vllm.v1.request import RequestStatus

        req_id = self.by_tag.get(tag)
        request = scheduler.requests.get(req_id) if req_id else None
        if request is None or request.is_finished():
            return {"ok": False, "error": "no such running request", "running": False}
        if request.status != RequestStatus.RUNNING or req_id in self.mig_of_request:
            return {"ok": False, "error": f"request is {request.status}", "running": True}
        self.outgoing[mig_id] = Outgoing(request.request_id, dest, bandwidth)
        self.mig_of_request[request.request_id] = mig_id
        return {"ok": True, "num_tokens": request.num_tokens}

    def cmd_stage(self, scheduler: Scheduler, engine: Any, mig_id: str) -> dict[str, Any]:
        """Order a copy of the blocks that filled since the last stage."""
        from vllm.v1.request import RequestStatus

        out = self.outgoing.get(mig_id)
        if out is None or out.state != "copying":
            return {"ok": False, **(out.report() if out else {"state": "unknown"})}
        request = scheduler.requests[out.req_id]
        if request.status != RequestStatus.RUNNING:  # preempted: its blocks are gone
            return {"ok": True, "ordered": 0, "remaining": 0, **out.report()}
        assert self.kv is not None
        full = request.num_computed_tokens // self.block_size
        ids = self.kv.get_block_ids(out.req_id)[0]
        new = [(i, ids[i]) for i in range(out.scheduled, full)]
        if new:
            self.orders.copies.append(CopyOrder(mig_id, out.dest, new, out.bandwidth))
            out.scheduled = full
            out.stages += 1
        return {"ok": True, "ordered": len(new), **out.report()}

    def cmd_pending(self, scheduler: Scheduler, engine: Any, mig_id: str) -> dict[str, Any]:
        """How many full blocks a stage would copy now."""
        out = self.outgoing.get(mig_id)
        if out is None:
            return {"ok": False, "state": "unknown"}
        request = scheduler.requests.get(out.req_id)
        full = request.num_computed_tokens // self.block_size if request else out.scheduled
        return {"ok": True, "pending": max(0, full - out.scheduled), **out.report()}

    def cmd_stop(self, scheduler: Scheduler, engine: Any, mig_id: str) -> dict[str, Any]:
        """Stop the request between steps and answer with the engine's token ids at
        once; its last blocks go out in the next step, while Ferry already starts
        the continuation (the destination holds it until they land)."""
        from vllm.v1.request import RequestStatus

        out = self.outgoing.get(mig_id)
        if out is None or out.state != "copying":
            return {"ok": False, **(out.report() if out else {"state": "unknown"})}
        request = scheduler.requests.get(out.req_id)
        if request is None or request.status != RequestStatus.RUNNING:
            return {"ok": False, "error": "request not running", **out.report()}
        token_ids = list(request.all_token_ids)
        computed = request.num_computed_tokens
        out.state = "stopping"
        aborted = scheduler.finish_requests(out.req_id, RequestStatus.FINISHED_ABORTED)
        engine._send_abort_outputs(aborted)
        return {"ok": True, "token_ids": token_ids, "num_computed": computed, **out.report()}

    def cmd_status(self, scheduler: Scheduler, engine: Any, mig_id: str) -> dict[str, Any]:
        return self._status(mig_id)

    def _status(self, mig_id: str) -> dict[str, Any]:
        out = self.outgoing.get(mig_id)
        return {"ok": out is not None, **(out.report() if out else {"state": "unknown"})}

    def cmd_wait(
        self, scheduler: Scheduler, engine: Any, mig_id: str
    ) -> dict[str, Any] | Future[dict[str, Any]]:
        """Answer once the copies ordered so far are through, or the migration ended."""
        if self._stage_done(mig_id):
            return self._status(mig_id)
        future: Future[dict[str, Any]] = Future()
        self.waiters.append((mig_id, future))
        return future

    def _stage_done(self, mig_id: str) -> bool:
        out = self.outgoing.get(mig_id)
        return out is None or out.state != "copying" or out.acked >= out.scheduled

    def _answer_waiters(self) -> None:
        waiting = []
        for mig_id, future in self.waiters:
            if self._stage_done(mig_id):
                future.set_result(self._status(mig_id))
            else:
                waiting.append((mig_id, future))
        self.waiters = waiting

    def cmd_forget(self, scheduler: Scheduler, engine: Any, mig_id: str) -> dict[str, Any]:
        """Drop a migration record; one still copying is rolled back (the request
        simply runs on here)."""
        out = self.outgoing.get(mig_id)
        if out is not None and out.state == "stopped":
            out.forgotten = True  # its commit is still to come: drop it then
        elif out is not None:
            del self.outgoing[mig_id]
            if out.state != "done":
                self.orders.cancels.append(mig_id)
            if self.mig_of_request.get(out.req_id) == mig_id:
                del self.mig_of_request[out.req_id]
        self._answer_waiters()
        return {"ok": True}

    # -- reservations -----------------------------------------------------------------
    def _pool(self) -> Any:
        assert self.kv is not None, "bind_kv_cache_manager was not called"
        return self.kv.block_pool

    def _free_reservation(self, mig_id: str) -> None:
        reservation = self.reserved.pop(mig_id, None)
        if reservation is not None:
            self._pool().free_blocks(reservation.blocks)

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        for mig_id, reservation in list(self.reserved.items()):
            if reservation.expires < now:
                log.warning("migration %s: reservation unclaimed, freed", mig_id)
                self._free_reservation(mig_id)
                self.orders.drops.append(mig_id)


def _params(request: Request) -> dict[str, Any]:
    params = request.kv_transfer_params
    return params if isinstance(params, dict) else {}


def _load(request: Request) -> tuple[str, int] | None:
    """The staged KV a continuation names (`wire.LOAD`): its migration and token
    count, or None. A client's own `kv_transfer_params` reach the engine too,
    and these hooks run inside the engine's step, where an exception ends the
    engine: a load in any other shape than Ferry's is no load."""
    load = _params(request).get(wire.LOAD)
    if not isinstance(load, dict):
        return None
    mig_id, tokens = load.get("mig_id"), load.get("num_tokens")
    if not isinstance(mig_id, str) or type(tokens) is not int or tokens < 0:
        return None
    return mig_id, tokens
