"""Full-mode migration: move a live stream *with its KV cache* between shim instances.

Ferry only conducts; the instances' migration_shim does the copying (see
`migration_shim.control`). One move:
1. the destination reserves blocks for the request (refused: the request stays);
2. the source pre-copies the request's full KV blocks in stages while it keeps
   decoding, then stops it between two engine steps and sends the rest;
3. the stream cuts over exactly as in lite mode, while the last blocks travel;
   the continuation carries a `LOAD` marker, so the destination waits for them
   and loads P + G's KV instead of recomputing it.
A failure before the stop rolls back: the request never left the source. After
it, blocks that never land are recomputed by the destination, and a destination
that died fails the continuation, which resumes elsewhere by recompute (lite):
no request is lost either way.

This module only talks to the shims; the migrator applies the outcome to the
stream (see `migrator.Migrator.move`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from migration_shim import wire
from proxy.cluster import Cluster
from proxy.metrics import FerryMetrics
from proxy.upstream import Upstreams

log = logging.getLogger("ferry.migration")


@dataclass(frozen=True, slots=True)
class FullModeSettings:
    max_stages: int = 3
    last_stage_blocks: int = 1
    bandwidth_mb_s: float = 0.0
    reserve_lease_s: float = 30.0
    # The whole copy, stages and stop; past it the move falls back to lite. KV of
    # a few thousand tokens copies in milliseconds without a bandwidth cap.
    timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class KVOutcome:
    """How a full-mode copy ended. `stopped`: the source no longer runs the
    request, so it must continue somewhere; `load`: the KV staged for it at the
    destination (None: the continuation recomputes); `finished`: the request
    ended at the source meanwhile (nothing left to move); `refused`: the
    destination has no room for it (nor for a recompute)."""

    stopped: bool
    load: dict[str, Any] | None = None
    finished: bool = False
    refused: bool = False
    # The stream failed over while the source was copying: the copy is of no
    # use now, its reservation freed and its answer not awaited.
    abandoned: bool = False


class KVMigrator:
    def __init__(
        self,
        cluster: Cluster,
        upstreams: Upstreams,
        metrics: FerryMetrics,
        settings: FullModeSettings,
    ) -> None:
        self.cluster = cluster
        self.upstreams = upstreams
        self.metrics = metrics
        self.settings = settings

    def applies(self, source: str, destination: str) -> bool:
        """Full mode needs the shim on both ends and compatible KV."""
        src = self.cluster.instances[source]
        dest = self.cluster.instances.get(destination)
        if dest is None or src.migration_mode != "full" or dest.migration_mode != "full":
            return False
        assert src.shim is not None and dest.shim is not None
        # Shapes and instruction set are checked by the shims when their channel opens.
        mismatch = wire.layout_mismatch(src.shim, dest.shim, wire.INFO_LAYOUT_KEYS)
        if mismatch is not None:
            log.info("full migration %s -> %s impossible: %s", source, destination, mismatch)
        return mismatch is None

    async def copy(
        self,
        source: str,
        destination: str,
        tag: str,
        tokens: int,
        reason: str,
        expect_stop: Callable[[bool], None],
        moot: asyncio.Event | None = None,
    ) -> KVOutcome:
        """Copy the KV of the request tagged `tag` (`tokens` long) from `source` to
        `destination`. `expect_stop(True)` is called before the source may stop
        it, `expect_stop(False)` once it is known not to have. Once `moot` is set
        (the stream went elsewhere without this copy) the copy is given up."""
        dest = self.cluster.instances[destination]
        assert dest.shim is not None
        # Read now: a failed shim refresh may clear `dest.shim` during the awaits.
        dest_addr = dest.shim["kv_addr"]
        mig_id = uuid.uuid4().hex
        blocks = -(-tokens // int(dest.shim["block_size"])) + 1  # and room to go on
        reserved = await self.upstreams.post_json(
            destination,
            wire.RESERVE,
            {"mig_id": mig_id, "num_blocks": blocks, "lease_s": self.settings.reserve_lease_s},
        )
        if not isinstance(reserved, dict) or "error" in reserved:
            self._count(reason, "destination_full")
            log.info("full migration to %s refused: %s", destination, _why(reserved))
            return KVOutcome(stopped=False, refused=True)
        expect_stop(True)
        migrate = self.upstreams.post_json(
            source,
            wire.MIGRATE,
            {
                "mig_id": mig_id,
                "tag": tag,
                "dest_addr": dest_addr,
                "max_stages": self.settings.max_stages,
                "last_stage_blocks": self.settings.last_stage_blocks,
                "bandwidth_mb_s": self.settings.bandwidth_mb_s,
                "timeout_s": self.settings.timeout_s,
            },
            timeout_s=self.settings.timeout_s + 10,
        )
        result = await _unless(moot, migrate)
        if result is _MOOT:
            # A hung source answers late, if ever; meanwhile the reservation
            # would starve the destination the stream failed over to.
            await self.release(destination, mig_id)
            expect_stop(False)
            self._count(reason, "abandoned")
            log.info("full migration of %s abandoned: the stream went on without it", tag)
            return KVOutcome(stopped=False, abandoned=True)
        result = result if isinstance(result, dict) else None
        outcome = (result or {}).get("outcome")
        if outcome == wire.STOPPED:
            assert result is not None
            self._count(reason, "ok")
            self.metrics.kv_migrated_blocks.inc(int(result.get("blocks", 0)))
            self.metrics.kv_precopy_stages.inc(int(result.get("stages", 0)))
            log.info(
                "KV of %s moving %s -> %s (%s): %s blocks, %s pre-copy stages, stop %.1f ms",
                tag,
                source,
                destination,
                reason,
                result.get("blocks"),
                result.get("stages"),
                1000 * float(result.get("stop_s", 0)),
            )
            load = {
                "mig_id": mig_id,
                "num_tokens": int(result["num_computed"]),
                "dest": destination,
            }
            return KVOutcome(stopped=True, load=load)
        await self.release(destination, mig_id)
        if outcome == wire.FAILED_AFTER_STOP:
            # The source has stopped the request: it must continue somewhere.
            self._count(reason, "fell_back_to_lite")
            log.warning("full migration of %s failed after the stop: %s", tag, _why(result))
            return KVOutcome(stopped=True)
        if outcome is not None:
            # Known not stopped. With no answer at all it may have been: then an
            # abort from the source still counts as a stop, and the stream resumes.
            expect_stop(False)
        finished = outcome == wire.SOURCE_FINISHED
        if result is None:  # (its source died, or broke the call: not known to go on)
            self._count(reason, "no_answer")
        else:
            self._count(reason, "source_finished" if finished else "rolled_back")
        log.info("full migration of %s did not happen: %s", tag, _why(result))
        return KVOutcome(stopped=False, finished=finished)

    async def release(self, instance: str, mig_id: str) -> None:
        """Free a destination's reservation and staged blocks (best effort: both
        also expire on their own)."""
        await self.upstreams.post_json(instance, wire.RELEASE, {"mig_id": mig_id})

    def _count(self, reason: str, outcome: str) -> None:
        self.metrics.kv_migrations.labels(reason, outcome).inc()


_MOOT = object()


async def _unless(moot: asyncio.Event | None, call: Coroutine[Any, Any, Any]) -> Any:
    """`call`'s result, or _MOOT (the call cancelled) once `moot` is set first."""
    task = asyncio.ensure_future(call)
    if moot is None:
        return await task
    waiter = asyncio.ensure_future(moot.wait())
    try:
        done, _ = await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()  # moot, or this move itself cancelled
    return task.result() if task in done else _MOOT


def _why(answer: Any) -> str:
    if not isinstance(answer, dict):
        return "no answer"
    error = answer.get("error")
    if isinstance(error, dict):
        return str(error.get("message"))
    return str(error or answer.get("outcome"))
